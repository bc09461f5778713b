"""k8s.yaml, checked offline (no cluster here): every standard object against Kubernetes'
own JSON schemas (kubernetes-validate, strict: unknown fields fail) for every Kubernetes
version the package ships; the KEDA objects against models generated from KEDA's CRD schemas
(cloudcoil-models-keda; strict types, and a field the models do not know fails too); then
the contracts between the objects and the code: the commands parse with the real `fanout`
parser, the ScaledObject watches the Redis lists rq really uses, the drain fits in the grace
period, Services select their pods, probes hit what the processes serve, nothing runs as
root, and the worker's probe passes only for a live registration of its own pod."""
import copy
import datetime
import os
import re
import socket

import pytest
import redis as redis_lib
import rq
import yaml

from cli import redis_server
from cli.main import parser
from jobs import models as fleet
from jobs.spec import queues as model_queues

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "fanout"
LABEL = {"app.kubernetes.io/name": "fanout"}
KEDA = "keda.sh/v1alpha1"
PASSWORD = "0123456789abcdef"  # what the Secret would hold in this test
FANOUT_UID = 10001  # Dockerfile: useradd --uid


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    with open(os.path.join(ROOT, "k8s.yaml")) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def one(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def workers(docs) -> list[dict]:
    """The worker Deployments: one per model."""
    found = [d for d in docs if d["kind"] == "Deployment"
             and d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    assert len(found) >= 2  # k8s.yaml shows a fleet of two models
    return found


def served(worker: dict) -> str:
    """The served name of a worker Deployment's model (its FANOUT_SERVED_MODEL_NAME)."""
    return container_env(container(worker))["FANOUT_SERVED_MODEL_NAME"]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict, name: str | None = None) -> dict:
    cs = pod_spec(workload)["containers"]
    return next(c for c in cs if name is None or c["name"] == name)


def fanout_containers(docs) -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs the Fanout image."""
    return [(w, c) for w in workloads(docs) for c in pod_spec(w)["containers"]
            if c.get("command", [None])[0] == "fanout"]


def container_env(c: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: a secret's value for each
    secretKeyRef (PASSWORD here), and `$(VAR)` replaced by a variable defined before it."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "valueFrom" in e:
            assert set(e["valueFrom"]) == {"secretKeyRef"}, e
            value = PASSWORD
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        env[e["name"]] = value
    return env


def parse(c: dict, monkeypatch):
    """The container's command through the real `fanout` parser, with its environment."""
    cmd = c["command"]
    assert cmd[0] == "fanout" and "args" not in c, cmd  # exec form: signals reach fanout
    for k, v in container_env(c).items():
        monkeypatch.setenv(k, v)
    return parser().parse_args(cmd[1:])  # SystemExit (a failure) on a flag it lacks


def port_number(c: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- schemas ----------------------------------------------------------------------------------

def test_every_object_is_namespaced_and_labelled(docs):
    ns = one(docs, "Namespace", NAMESPACE)
    # Pod Security "restricted" on the namespace: the API server itself refuses a pod that
    # could run as root or gain privileges.
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    seen = set()
    for d in docs:
        meta = d["metadata"]
        key = (d["kind"], meta["name"])
        assert key not in seen, key
        seen.add(key)
        assert matches(LABEL, meta.get("labels", {})), key
        if d["kind"] != "Namespace":
            assert meta.get("namespace") == NAMESPACE, key
            assert meta["labels"].get("app.kubernetes.io/component") in ("redis", "api", "worker"), key
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(w["spec"]["selector"]["matchLabels"], labels)
        if w in workers(docs):  # a Deployment per model: its pods carry the model's name
            assert labels == {**LABEL, "app.kubernetes.io/component": "worker", "fanout/model": served(w)}
        else:
            assert labels == {**LABEL, "app.kubernetes.io/component": w["metadata"]["name"]}


def test_standard_objects_match_the_kubernetes_schemas(docs):
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    versions = sorted({v.rsplit(".", 1)[0] for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    assert "1.25" in versions and len(versions) >= 10, versions
    standard = [d for d in docs if d["apiVersion"] != KEDA]
    assert {d["kind"] for d in standard} >= {"Namespace", "Service", "StatefulSet", "Deployment",
                                             "NetworkPolicy", "PodDisruptionBudget"}
    errors = []
    for version in versions:
        for d in standard:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(map(str, e.path))
                errors.append(f"{version} {d['kind']}/{d['metadata']['name']}: {where}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:  # an apiVersion it lacks
                errors.append(f"{version} {d['kind']}/{d['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


def test_the_schema_check_catches_mistakes(docs):
    """The strict schemas reject what a typo in k8s.yaml would look like."""
    import kubernetes_validate

    bad = copy.deepcopy(one(docs, "Deployment", "worker-chat"))
    container(bad)["resources"]["limit"] = {"nvidia.com/gpu": 1}  # `limits`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37", strict=True)
    bad = copy.deepcopy(one(docs, "Deployment", "worker-chat"))
    pod_spec(bad)["terminationGracePeriodSeconds"] = "180"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37", strict=True)


def _unknown(given, parsed, path=""):
    """Paths present in `given` that a pydantic model dropped (fields it does not know)."""
    if isinstance(given, dict):
        assert isinstance(parsed, dict), path
        out = []
        for k, v in given.items():
            if k not in parsed:
                out.append(f"{path}.{k}")
            else:
                out += _unknown(v, parsed[k], f"{path}.{k}")
        return out
    if isinstance(given, list):
        return [p for i, (g, q) in enumerate(zip(given, parsed)) for p in _unknown(g, q, f"{path}[{i}]")]
    return []


def keda_check(d: dict) -> list[str]:
    """Strict validation against the models generated from KEDA's CRD schemas: wrong types
    and missing required fields raise; unknown fields (which pydantic drops) are returned."""
    from cloudcoil.models.keda import v1alpha1

    model = getattr(v1alpha1, d["kind"]).model_validate(d, strict=True)
    return _unknown(d, model.model_dump(by_alias=True, exclude_unset=True, mode="json"))


def test_keda_objects_match_the_keda_crd_schemas(docs):
    import pydantic

    keda = [d for d in docs if d["apiVersion"] == KEDA]
    assert sorted(d["kind"] for d in keda) == ["ScaledObject"] * len(workers(docs)) + ["TriggerAuthentication"]
    for d in keda:
        assert keda_check(d) == [], d["kind"]
    # The check sees mistakes: a misspelt field, a number where the CRD has a string.
    so = copy.deepcopy(one(docs, "ScaledObject", "worker-chat"))
    so["spec"]["minReplicas"] = 1
    so["spec"]["advanced"]["scalingModifiers"]["formulas"] = "x"
    assert sorted(keda_check(so)) == [".spec.advanced.scalingModifiers.formulas", ".spec.minReplicas"]
    so = copy.deepcopy(one(docs, "ScaledObject", "worker-chat"))
    so["spec"]["triggers"][0]["metadata"]["listLength"] = 2
    with pytest.raises(pydantic.ValidationError):
        keda_check(so)


# -- contracts between the objects and the code -----------------------------------------------

def test_commands_parse_with_the_fanout_cli(docs, monkeypatch):
    api = parse(container(one(docs, "Deployment", "api")), monkeypatch)
    assert api.cmd == "api" and api.host == "0.0.0.0"
    assert api.port == port_number(container(one(docs, "Deployment", "api")), "http")
    monkeypatch.undo()
    names = set()
    for w in workers(docs):
        monkeypatch.undo()
        worker = parse(container(w), monkeypatch)
        assert worker.cmd == "worker" and worker.device == "cuda" and worker.model
        assert not worker.burst
        # Its Prometheus metrics on every address, on the container port a Prometheus finds by name.
        assert worker.metrics_port == port_number(container(w), "metrics") and worker.metrics_host == "0.0.0.0"
        names.add(served(w))  # read by the worker at start (the flag's default)
    assert len(names) == len(workers(docs))  # each Deployment its own model


def test_every_fanout_process_gets_the_password_in_redis_url(docs, monkeypatch):
    redis_svc = one(docs, "Service", "redis")
    redis_ct = container(one(docs, "StatefulSet", "redis"))
    (svc_port,) = redis_svc["spec"]["ports"]
    secret_refs = set()
    for w, c in fanout_containers(docs):
        names = [e["name"] for e in c["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), "$(VAR) needs VAR first"
        pw = next(e for e in c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
        secret_refs.add((pw["name"], pw["key"]))
        raw = next(e for e in c["env"] if e["name"] == "REDIS_URL")["value"]
        assert "$(REDIS_PASSWORD)" in raw
        args = parse(c, monkeypatch)
        monkeypatch.undo()
        kw = redis_lib.Redis.from_url(args.redis_url).connection_pool.connection_kwargs
        assert kw["password"] == PASSWORD
        assert kw["host"] == redis_svc["metadata"]["name"]  # same namespace: the short name
        assert w["metadata"]["namespace"] == redis_svc["metadata"]["namespace"]
        assert kw["port"] == svc_port["port"]
        assert port_number(redis_ct, svc_port["targetPort"]) == 6379
    # Redis requires that same password, keeps an append-only file on its volume.
    args = redis_ct["args"]
    assert args[0] == "redis-server"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert args[args.index("--appendonly") + 1] == "yes"
    for w in workloads(docs):  # REDISCLI_AUTH (Redis's probe) too
        for c in pod_spec(w)["containers"]:
            secret_refs |= {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                            for e in c.get("env", []) if "valueFrom" in e}
    auth = one(docs, "TriggerAuthentication", "redis")["spec"]["secretTargetRef"]
    assert [a["parameter"] for a in auth] == ["password"]
    secret_refs.add((auth[0]["name"], auth[0]["key"]))
    assert len(secret_refs) == 1, secret_refs  # one Secret, one key, everywhere
    # ... the Secret that k8s.yaml's header and docs/deployment.md tell you to create.
    (name, key), = secret_refs
    create = re.compile(r"kubectl -n fanout create secret generic (\S+) --from-literal=(\w+)=")
    for path in ("k8s.yaml", "docs/deployment.md"):
        with open(os.path.join(ROOT, path)) as f:
            assert [c for c in create.findall(f.read()) if c[0] == name] == [(name, key)], path
    sts = one(docs, "StatefulSet", "redis")
    data = args[args.index("--dir") + 1]
    mount = next(m for m in redis_ct["volumeMounts"] if m["mountPath"] == data)
    assert mount["name"] in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]


def test_the_api_reads_the_blob_store_from_the_secret_the_instructions_create(docs):
    """Every API replica and worker must reach the same store: a bucket, named by the blob-store Secret
    (FANOUT_STORAGE_URL and the AWS_* variables), which k8s.yaml's header and docs/deployment.md create."""
    refs = set()
    for d in [one(docs, "Deployment", "api"), *workers(docs)]:  # workers read large jobs' items from it
        (c,) = pod_spec(d)["containers"]
        refs.update(e["secretRef"]["name"] for e in c["envFrom"])
    (ref,) = refs
    create = re.compile(rf"kubectl -n fanout create secret generic {ref} --from-literal=FANOUT_STORAGE_URL=s3://")
    for path in ("k8s.yaml", "docs/deployment.md"):
        with open(os.path.join(ROOT, path)) as f:
            assert len(create.findall(f.read())) == 1, path


def test_the_instructions_name_what_the_file_uses(docs):
    """k8s.yaml's header and docs/deployment.md: the namespace created first, and the image that the
    sed command replaces."""
    (image,) = {c["image"] for _, c in fanout_containers(docs)}
    for path in ("k8s.yaml", "docs/deployment.md"):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert f"kubectl create namespace {NAMESPACE}\n" in text, path
        assert re.findall(r"sed 's#image: (\S+)#image: REGISTRY/", text) == [image], path
        assert f"docker build -t REGISTRY/{image.split('/')[-1]} ." in text, path


def test_each_models_scaledobject_watches_its_rq_queue_lists(docs):
    conn = redis_lib.Redis()  # rq builds keys without connecting
    for w in workers(docs):
        name = w["metadata"]["name"]
        so = one(docs, "ScaledObject", name)["spec"]
        target = so["scaleTargetRef"]
        assert (target.get("apiVersion"), target.get("kind"), target["name"]) == ("apps/v1", "Deployment", name)
        assert "replicas" not in w["spec"]  # KEDA's HPA sets it
        keys = [rq.Queue(q, connection=conn).key for q in model_queues(served(w))]
        assert keys == [f"rq:queue:fanout:{served(w)}:{p}" for p in ("high", "normal", "low")]  # rq 3
        triggers = so["triggers"]
        assert [t["metadata"]["listName"] for t in triggers] == keys
        svc = one(docs, "Service", "redis")
        url = next(e for e in container(w)["env"] if e["name"] == "REDIS_URL")
        db = re.fullmatch(r"redis://.*/(\d+)", url["value"]).group(1)  # the workers' database
        for t in triggers:
            assert t["type"] == "redis"  # LLEN of a list
            assert t["authenticationRef"]["name"] == "redis"
            md = t["metadata"]
            # KEDA's operator runs in its own namespace: the Service's namespaced name.
            assert md["address"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:" \
                                    f"{svc['spec']['ports'][0]['port']}"
            assert md["databaseIndex"] == db and int(md["listLength"]) >= 1
            assert not any(k.startswith("password") for k in md)  # from the TriggerAuthentication
        # One metric: the lists summed, each once.
        mod = so["advanced"]["scalingModifiers"]
        terms = [s.strip() for s in mod["formula"].split("+")]
        assert sorted(terms) == sorted(t["name"] for t in triggers)
        assert mod["metricType"] == "AverageValue" and int(mod["target"]) >= 1
        # To zero when idle: the first waiting shard wakes a worker.
        assert so["minReplicaCount"] == 0 < so["maxReplicaCount"] and int(mod["activationTarget"]) == 0
        assert so["cooldownPeriod"] > 0
        down = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300  # no scale-in on a momentarily empty queue


def test_the_api_knows_every_workers_model_while_it_is_scaled_to_zero(docs, monkeypatch):
    """FANOUT_MODELS on the API names each worker Deployment's model with its task: a job for
    a model whose workers are at zero is taken and waits (and its queue wakes them)."""
    monkeypatch.setenv("FANOUT_MODELS", container_env(container(one(docs, "Deployment", "api")))["FANOUT_MODELS"])
    tasks = {served(w): ("embed" if "bge" in container_env(container(w))["FANOUT_MODEL"] else "generate")
             for w in workers(docs)}
    assert fleet.configured() == tasks


def test_scale_in_drains_before_the_kill(docs, monkeypatch):
    for worker in workers(docs):
        args = parse(container(worker), monkeypatch)
        grace = pod_spec(worker)["terminationGracePeriodSeconds"]
        # SIGTERM: --drain-timeout for running jobs, then the hand-back (Redis writes) before
        # Kubernetes' SIGKILL at the end of the grace period.
        assert grace >= args.drain_timeout + 30, (grace, args.drain_timeout)
        assert "preStop" not in container(worker).get("lifecycle", {})
        strategy = worker["spec"]["strategy"]["rollingUpdate"]
        assert strategy["maxSurge"] == 0  # a rollout does not need a spare GPU


def test_services_select_their_pods(docs):
    pods = {w["metadata"]["name"]: w for w in workloads(docs)}
    for svc in (d for d in docs if d["kind"] == "Service"):
        spec = svc["spec"]
        assert spec.get("type", "ClusterIP") == "ClusterIP", svc["metadata"]["name"]  # none exposed
        assert "externalIPs" not in spec
        chosen = [n for n, w in pods.items() if matches(spec["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert chosen == [svc["metadata"]["name"]], (svc["metadata"]["name"], chosen)
        for p in spec["ports"]:
            port_number(container(pods[chosen[0]]), p["targetPort"])  # a port the container has
    assert one(docs, "StatefulSet", "redis")["spec"]["serviceName"] == "redis"
    pdb = one(docs, "PodDisruptionBudget", "api")["spec"]["selector"]["matchLabels"]
    assert [n for n, w in pods.items() if matches(pdb, w["spec"]["template"]["metadata"]["labels"])] == ["api"]
    # Redis takes connections from Fanout's pods (and KEDA's namespace) only.
    np = one(docs, "NetworkPolicy", "redis")["spec"]
    assert [n for n, w in pods.items() if matches(np["podSelector"]["matchLabels"],
                                                  w["spec"]["template"]["metadata"]["labels"])] == ["redis"]
    sources = np["ingress"][0]["from"]
    local = next(s["podSelector"]["matchLabels"] for s in sources if "podSelector" in s)
    assert {n for n, w in pods.items() if matches(local, w["spec"]["template"]["metadata"]["labels"])} \
        >= {"api", *(w["metadata"]["name"] for w in workers(docs))}
    assert any(s.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "keda"}
               for s in sources)
    assert [p["port"] for p in np["ingress"][0]["ports"]] == [6379]
    assert not [d for d in docs if d["kind"] == "Ingress"]


def test_api_probes_hit_healthz_on_the_container_port(docs, monkeypatch):
    from api.app import create_app
    from jobs.settings import Settings

    api = one(docs, "Deployment", "api")
    c = container(api)
    args = parse(c, monkeypatch)
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and port_number(c, get["port"]) == args.port, probe
    app = create_app(Settings())
    assert any(getattr(r, "path", None) == "/healthz" and "GET" in r.methods for r in app.routes)
    # Redis away: not ready at once, restarted only after minutes (a restart does not help).
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert api["spec"]["replicas"] >= 2


def _exit_code(code: str) -> int:
    try:
        exec(compile(code, "<probe>", "exec"), {})
    except SystemExit as e:
        return 0 if e.code in (None, 0, False) else 1
    except Exception:
        return 1
    return 0


def test_worker_probes_want_a_fresh_registration_from_this_pod(docs, monkeypatch):
    c = container(one(docs, "Deployment", "worker-chat"))
    assert all(container(w)["livenessProbe"] == c["livenessProbe"] for w in workers(docs))
    start, live = c["startupProbe"], c["livenessProbe"]
    assert start["exec"] == live["exec"]
    cmd = live["exec"]["command"]
    assert cmd[:2] == ["python", "-c"] and len(cmd) == 3
    # The model loads before the worker registers: the startup probe allows minutes.
    assert start["periodSeconds"] * start["failureThreshold"] >= 600
    server = redis_server.EmbeddedRedis()
    try:
        redis_lib.Redis.from_url(server.url).config_set("requirepass", PASSWORD)
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        monkeypatch.setenv("REDIS_URL", url)
        conn = redis_lib.Redis.from_url(url)
        assert _exit_code(cmd[2]) == 1  # not registered yet (loading its model)
        w = rq.Worker(["fanout"], connection=conn, name="fanout-k8s-test")
        w.register_birth()
        w.heartbeat()
        assert _exit_code(cmd[2]) == 0
        stale = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        conn.hset(w.key, "last_heartbeat", stale.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        assert _exit_code(cmd[2]) == 1  # hung: no heartbeat for minutes
        w.heartbeat()
        conn.hset(w.key, "hostname", "another-pod")
        assert _exit_code(cmd[2]) == 1  # another pod's worker does not count
        assert socket.gethostname() != "another-pod"
    finally:
        server.stop()


def test_nothing_runs_as_root(docs):
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    uid = int(re.search(r"useradd --uid (\d+)", dockerfile).group(1))
    assert uid == FANOUT_UID
    fanout = {id(c) for _, c in fanout_containers(docs)}
    for w in workloads(docs):
        spec = pod_spec(w)
        name = w["metadata"]["name"]
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name  # none calls the Kubernetes API
        assert spec["enableServiceLinks"] is False, name  # a Service `fanout` would set FANOUT_PORT
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), (name, key)
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            user = sc.get("runAsUser", pod_sc.get("runAsUser"))
            assert user not in (None, 0), (name, c["name"])
            assert sc.get("runAsNonRoot", True) is True
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            if id(c) in fanout:
                assert user == FANOUT_UID, (name, c["name"])
        for v in spec.get("volumes", []):
            assert "hostPath" not in v, (name, v["name"])


def test_the_worker_gets_a_gpu_and_writable_caches(docs):
    for worker in workers(docs):
        c = container(worker)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = container_env(c)
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        # A read-only root filesystem: the Hugging Face cache, HOME (Triton's ~/.triton, other
        # caches) and /tmp (Triton's launcher build) are volumes.
        with open(os.path.join(ROOT, "Dockerfile")) as f:
            home = re.search(r"--home-dir (\S+)", f.read()).group(1)
        assert env["HOME"] == home
        for path in (env["HF_HOME"], env["HOME"], "/tmp"):
            assert any(path == m or path.startswith(m + "/") for m in mounts), path
        volumes = {v["name"]: v for v in pod_spec(worker)["volumes"]}
        assert all("emptyDir" in volumes[m["name"]] or "persistentVolumeClaim" in volumes[m["name"]]
                   for m in c["volumeMounts"])
        images = {c["image"] for _, c in fanout_containers(docs)}
        assert len(images) == 1  # the Dockerfile's one image for the API and the workers


def test_only_fanout_pods_and_the_keda_operator_reach_redis(docs):
    """Not every pod of KEDA's namespace: its operator's pods (both selectors in one entry)."""
    policy = one(docs, "NetworkPolicy", "redis")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    [rule] = policy["spec"]["ingress"]
    sources = rule["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fanout"}}} in sources
    keda = [s for s in sources if "namespaceSelector" in s]
    assert keda == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
                     "podSelector": {"matchLabels": {"app": "keda-operator"}}}]
    assert len(sources) == 2 and rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
