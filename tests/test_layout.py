"""The packages' import rules (docs/ARCHITECTURE.md, "Packages"), read from the source: what
the API and the worker share lives in jobs/ and results/, so neither imports the other, and
the engine imports nothing of the service."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> the top-level modules it may not import ("worker" means the worker process:
# worker.engine is allowed where "worker.engine" is not listed)
FORBIDDEN = {
    "api": {"worker", "cli"},
    "results": {"worker", "cli", "api", "jobs"},
    "jobs": {"worker", "cli", "api"},
    "worker": {"cli", "api"},
    "worker/engine": {"worker", "cli", "api", "jobs", "results"},
}


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


def files(package: str) -> list[str]:
    found = []
    for d, _, names in os.walk(os.path.join(ROOT, package)):
        found += [os.path.join(d, n) for n in names if n.endswith(".py")]
    assert found, package
    return found


def broken(package: str, path: str, module: str) -> bool:
    top = module.split(".")[0]
    if top not in FORBIDDEN[package]:
        return False
    if top == "worker" and package != "worker/engine":
        return not (module == "worker.engine" or module.startswith("worker.engine."))
    return True


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layout(package):
    bad = [f"{os.path.relpath(p, ROOT)}:{line}: {m}" for p in files(package)
           if not (package == "worker" and os.sep + "engine" + os.sep in p)
           for line, m in imports(p) if broken(package, p, m)]
    assert not bad, "\n".join(bad)


def test_the_worker_folder_holds_the_worker_process_alone():
    """No file of the CLI or of the shared contract at worker/'s top level."""
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "worker")) if n.endswith(".py"))
    assert not set(top) & {"cli.py", "commands.py", "flags.py", "up.py", "redis_server.py",
                           "spec.py", "shards.py", "items.py", "settings.py", "logs.py"}, top
