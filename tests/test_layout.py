"""The packages' import rules (docs/ARCHITECTURE.md, "Packages"), read from the source: what
the API and the worker share lives in jobs/ and results/, so neither imports the other, and
the engine imports nothing of the service."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> the top-level modules it may not import ("worker" means the worker process: the
# engines, worker.engine and worker.embedder, are allowed where "worker" is forbidden but
# they are not; worker.embedder may use worker.engine's parts, not the other way round)
FORBIDDEN = {
    "api": {"worker", "cli"},
    "results": {"worker", "cli", "api", "jobs"},
    "jobs": {"worker", "cli", "api"},
    "worker": {"cli", "api"},
    "worker/engine": {"worker", "cli", "api", "jobs", "results"},
    "worker/embedder": {"worker", "cli", "api", "jobs", "results"},
}
ENGINES = ("worker.engine", "worker.embedder")


def imports(path: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in the file, at any depth."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
    return out


def files(package: str, ext: str = ".py") -> list[str]:
    found = []
    for d, _, names in os.walk(os.path.join(ROOT, package)):
        found += [os.path.join(d, n) for n in names if n.endswith(ext)]
    assert found, package
    return found


def broken(package: str, path: str, module: str) -> bool:
    top = module.split(".")[0]
    if top not in FORBIDDEN[package]:
        return False
    allowed = {"worker/engine": (), "worker/embedder": ("worker.engine", "worker.embedder")}.get(package, ENGINES)
    if top == "worker":
        return not any(module == e or module.startswith(e + ".") for e in allowed)
    return True


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layout(package):
    bad = [f"{os.path.relpath(p, ROOT)}:{line}: {m}" for p in files(package)
           if not (package == "worker" and any(os.sep + e + os.sep in p for e in ("engine", "embedder")))
           for line, m in imports(p) if broken(package, p, m)]
    assert not bad, "\n".join(bad)


def test_the_worker_folder_holds_the_worker_process_alone():
    """No file of the CLI or of the shared contract at worker/'s top level."""
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "worker")) if n.endswith(".py"))
    assert not set(top) & {"cli.py", "commands.py", "flags.py", "up.py", "redis_server.py",
                           "spec.py", "shards.py", "items.py", "settings.py", "logs.py"}, top


def test_no_class_of_the_worker_process_has_two_bases_of_the_project():
    """The worker's parts are composed objects, not mixins on one `self`: a class may extend
    one class of the project's own at most (rq's BaseWorker is not the project's)."""
    own = set()
    trees = {}
    for p in files("worker"):
        if os.sep + "engine" + os.sep not in p and os.sep + "embedder" + os.sep not in p:
            trees[p] = ast.parse(open(p).read(), p)
            own |= {n.name for n in ast.walk(trees[p]) if isinstance(n, ast.ClassDef)}
    assert {"Consumer", "Member", "Attempts", "Link"} <= own
    bad = [f"{os.path.relpath(p, ROOT)}: {n.name}" for p, tree in trees.items() for n in ast.walk(tree)
           if isinstance(n, ast.ClassDef) and sum(isinstance(b, ast.Name) and b.id in own for b in n.bases) > 1]
    assert not bad, bad


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    import re
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def markdown(path: str) -> tuple[set[str], list[str]]:
    """A page's anchors and its relative link targets, code blocks and spans left out."""
    import re
    anchors, links, fence, seen = set(), [], False, {}
    for line in open(path).read().split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            a = slug(re.sub(r"`", "", m.group(1)))
            anchors.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
        line = re.sub(r"`[^`]*`", "", line)
        links += [t for t in re.findall(r"\]\(([^)\s]+)\)", line) if not re.match(r"[a-z]+:", t)]
    return anchors, links


def test_readme_is_a_landing_page_and_every_doc_link_resolves():
    """README stays short, links every page of docs/, and every relative link in README and
    docs/ names a file that exists and, with an anchor, a heading of that file."""
    readme = os.path.join(ROOT, "README.md")
    assert len(open(readme).read().splitlines()) <= 300
    pages = [readme] + files("docs", ".md")
    _, from_readme = markdown(readme)
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for t in from_readme}
    assert set(pages[1:]) <= linked
    broken = []
    for page in pages:
        for target in markdown(page)[1]:
            name, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), name)) if name else page
            if not os.path.exists(dest) or (anchor and dest.endswith(".md") and anchor not in markdown(dest)[0]):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not broken, broken
