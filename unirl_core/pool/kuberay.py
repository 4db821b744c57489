"""A KubeRay ``RayCluster`` (ray.io/v1) for the run's pool, generated from ``pool.kuberay`` and validated.

The setup task writes it as an artifact (``<checkpoint.root>/<run>/pool/raycluster.yaml``); a user applies it
(``kubectl apply -f raycluster.yaml``) and attaches the run with ``pool.address`` (the head service's Ray
client port, ``ray://<name>-head-svc.<namespace>.svc.cluster.local:10001``). Creating the cluster from the
task itself would need Kubernetes credentials in the task pod; the spec is the contract instead.

Validation checks what ``kubectl apply`` would not: every container has an image, requests equal limits
(Guaranteed QoS, GPUs need it), the Ray version is the one the pool runs, and every placement-group bundle
the pool will ask for fits one worker pod (the head runs no actors: ``num-cpus: "0"``), the whole group fits
the worker group.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec

from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError, field_error
from unirl_core.config.pool import KubeRayConfig, PoolConfig

API_VERSION = "ray.io/v1"
CLIENT_PORT, GCS_PORT, DASHBOARD_PORT = 10001, 6379, 8265
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEM = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_MEM_UNITS = {None: 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def cluster_name(cfg: RunConfig) -> str:
    """``pool.kuberay.name``, else ``<run>-pool`` lower-cased with other characters as '-' (DNS-1123)."""
    k = cfg.pool.kuberay
    if k is not None and k.name:
        return k.name
    return re.sub(r"[^a-z0-9-]+", "-", f"{cfg.name}-pool".lower()).strip("-")[:63]


def client_address(cfg: RunConfig) -> str:
    """The ``pool.address`` that attaches to the generated cluster from inside Kubernetes."""
    k = cfg.pool.kuberay
    ns = k.namespace if k is not None else "default"
    return f"ray://{cluster_name(cfg)}-head-svc.{ns}.svc.cluster.local:{CLIENT_PORT}"


def _resources(cpus: float, memory: str, gpus: int, gpu_resource: str) -> dict[str, dict[str, str]]:
    amount = {"cpu": f"{cpus:g}", "memory": memory}
    if gpus:
        amount[gpu_resource] = str(gpus)
    return {"requests": dict(amount), "limits": dict(amount)}


def _pod(k: KubeRayConfig, container: str, resources: dict, ports: list[dict] | None = None) -> dict:
    c: dict[str, Any] = {"name": container, "image": k.image, "resources": resources}
    if ports:
        c["ports"] = ports
    spec: dict[str, Any] = {"containers": [c]}
    if k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    return {"spec": spec}


def raycluster_spec(cfg: RunConfig) -> dict[str, Any]:
    """The RayCluster manifest (a dict ready for YAML) from ``cfg.pool.kuberay``."""
    k = cfg.pool.kuberay
    if k is None:
        raise field_error(ConfigError, "pool.kuberay", None, "a kuberay section (image, worker resources)",
                          "add pool.kuberay to the recipe, or attach to a running cluster with pool.address")
    ports = [{"containerPort": GCS_PORT, "name": "gcs"}, {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
             {"containerPort": CLIENT_PORT, "name": "client"}]
    head = {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
            "template": _pod(k, "ray-head", _resources(k.head_cpus, k.head_memory, 0, k.gpu_resource), ports)}
    worker = {"groupName": "workers", "replicas": k.worker_replicas, "minReplicas": k.worker_replicas,
              "maxReplicas": k.worker_replicas, "rayStartParams": {},
              "template": _pod(k, "ray-worker", _resources(k.worker_cpus, k.worker_memory, k.worker_gpus,
                                                            k.gpu_resource))}
    return {"apiVersion": API_VERSION, "kind": "RayCluster",
            "metadata": {"name": cluster_name(cfg), "namespace": k.namespace,
                         "labels": {"app.kubernetes.io/part-of": "unirl", "unirl/run": cluster_name(cfg)}},
            "spec": {"rayVersion": k.ray_version, "headGroupSpec": head, "workerGroupSpecs": [worker]}}


def pool_bundles(pcfg: PoolConfig) -> list[dict[str, float]]:
    """The placement-group bundles the pool will ask Ray for (``cluster.Pool._bundles``, without Ray)."""
    roles = [pcfg.engine] * pcfg.num_engines + [pcfg.trainer] * pcfg.trainer_ranks + [pcfg.reward]
    if pcfg.placement == "shared":  # one process: the trainer's resources host the engine too
        roles = [pcfg.trainer, pcfg.reward]
    needs = [{"CPU": r.num_cpus, "GPU": r.num_gpus} for r in roles]
    if pcfg.placement in ("colocate", "shared"):
        return [{"CPU": sum(n["CPU"] for n in needs), "GPU": sum(n["GPU"] for n in needs)}]
    return [n for n in needs if n["CPU"] > 0 or n["GPU"] > 0]


def _cpu(value: object, where: str) -> float:
    m = _CPU.match(str(value))
    if not m:
        raise field_error(ConfigError, where, value, "a Kubernetes CPU quantity ('4', '500m')", "e.g. '8'")
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def _memory(value: object, where: str) -> float:
    m = _MEM.match(str(value))
    if not m or float(m.group(1)) <= 0:
        raise field_error(ConfigError, where, value, "a Kubernetes memory quantity > 0 ('64Gi', '512Mi')",
                          "e.g. '64Gi'")
    return float(m.group(1)) * _MEM_UNITS[m.group(2)]


def _containers(group: dict, where: str) -> list[dict]:
    try:
        containers = group["template"]["spec"]["containers"]
    except (KeyError, TypeError):
        raise field_error(ConfigError, f"{where}.template.spec.containers", None, "a pod template with containers",
                          "generate the spec with raycluster_spec") from None
    if not containers:
        raise field_error(ConfigError, f"{where}.template.spec.containers", [], "at least one container",
                          "generate the spec with raycluster_spec")
    return containers


def _check_container(c: dict, where: str, gpu_resource: str) -> tuple[float, float]:
    """(CPUs, GPUs) the container requests, after checking image and requests == limits."""
    if not c.get("image"):
        raise field_error(ConfigError, f"{where}.image", c.get("image"), "a container image",
                          "set pool.kuberay.image (e.g. the train image built from images/)")
    res = c.get("resources") or {}
    req, lim = res.get("requests") or {}, res.get("limits") or {}
    for key in ("cpu", "memory"):
        if key not in req:
            raise field_error(ConfigError, f"{where}.resources.requests.{key}", None, "a request",
                              f"set pool.kuberay's {key} for this group")
    if req != lim:
        raise field_error(ConfigError, f"{where}.resources.limits", lim, f"equal to the requests {req}",
                          "Ray sizes itself from the limits; equal requests keep the pod Guaranteed")
    cpus = _cpu(req["cpu"], f"{where}.resources.requests.cpu")
    _memory(req["memory"], f"{where}.resources.requests.memory")
    gpus = req.get(gpu_resource, 0)
    if not str(gpus).isdigit():
        raise field_error(ConfigError, f"{where}.resources.requests.{gpu_resource}", gpus, "a whole number",
                          "GPUs are whole devices in Kubernetes")
    return cpus, float(gpus)


def validate_raycluster(spec: dict[str, Any], cfg: RunConfig) -> None:
    """Raise ConfigError naming the field when ``spec`` is malformed or cannot hold the pool's placement."""
    k = cfg.pool.kuberay
    gpu_resource = k.gpu_resource if k is not None else "nvidia.com/gpu"
    if spec.get("apiVersion") != API_VERSION or spec.get("kind") != "RayCluster":
        raise field_error(ConfigError, "raycluster.apiVersion/kind", (spec.get("apiVersion"), spec.get("kind")),
                          f"({API_VERSION!r}, 'RayCluster')", "KubeRay >= 1.0 serves ray.io/v1")
    name = (spec.get("metadata") or {}).get("name", "")
    if not _DNS1123.match(str(name)):
        raise field_error(ConfigError, "pool.kuberay.name", name, "a DNS-1123 label (lower-case letters, digits, "
                          "'-', at most 63)", "e.g. my-run-pool")
    body = spec.get("spec") or {}
    want = k.ray_version if k is not None else None
    if not body.get("rayVersion") or (want and body["rayVersion"] != want):
        raise field_error(ConfigError, "pool.kuberay.ray_version", body.get("rayVersion"),
                          f"the Ray version of the image ({want})", "keep it equal to the ray pin of the image")
    for c in _containers(body.get("headGroupSpec") or {}, "raycluster.spec.headGroupSpec"):
        _check_container(c, "raycluster.spec.headGroupSpec.container", gpu_resource)
    groups = body.get("workerGroupSpecs") or []
    if not groups:
        raise field_error(ConfigError, "raycluster.spec.workerGroupSpecs", [], "one worker group",
                          "the head runs no actors; the pool's actors need workers")
    capacity: list[tuple[float, float]] = []
    for i, g in enumerate(groups):
        where = f"raycluster.spec.workerGroupSpecs[{i}]"
        replicas = g.get("replicas")
        if not (isinstance(replicas, int) and replicas >= 1):
            raise field_error(ConfigError, "pool.kuberay.worker_replicas", replicas, "an integer >= 1", "e.g. 1")
        cpus, gpus = _check_container(_containers(g, where)[0], f"{where}.container", gpu_resource)
        capacity += [(cpus, gpus)] * replicas
    _check_placement(cfg, capacity)


def _check_placement(cfg: RunConfig, workers: list[tuple[float, float]]) -> None:
    bundles = pool_bundles(cfg.pool)
    biggest_cpu = max(c for c, _ in workers)
    biggest_gpu = max(g for _, g in workers)
    for res, attr, most, index in (("CPU", "worker_cpus", biggest_cpu, 0), ("GPU", "worker_gpus", biggest_gpu, 1)):
        one = max((b[res] for b in bundles), default=0.0)
        total = sum(b[res] for b in bundles)
        have = sum(w[index] for w in workers)
        if one > most + 1e-9 or total > have + 1e-9:
            k = cfg.pool.kuberay
            raise field_error(ConfigError, f"pool.kuberay.{attr}", most if k is None else getattr(k, attr), f"room for the pool's placement "
                              f"({cfg.pool.placement}): bundles {bundles}, largest {one:g} {res} in one pod, "
                              f"{total:g} {res} in all; the workers offer {have:g}",
                              f"raise pool.kuberay.{attr} or worker_replicas, or lower pool.*.num_{res.lower()}s"
                              " (pool.placement='separate' spreads the actors over pods)")


def to_yaml(spec: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(spec, sort_keys=False)


def write_raycluster(cfg: RunConfig) -> str:
    """Generate, validate and write the spec to ``<checkpoint.root>/<run>/pool/raycluster.yaml``; its URI."""
    spec = raycluster_spec(cfg)
    validate_raycluster(spec, cfg)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint.root, **cfg.checkpoint.storage_options)
    path = posixpath.join(root.rstrip("/"), cfg.name, "pool", "raycluster.yaml")
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, to_yaml(spec).encode())
    return path if "://" not in cfg.checkpoint.root else fs.unstrip_protocol(path)


def setup_pool(cfg: RunConfig) -> list[str]:
    """The setup task's pool step: with ``pool.kuberay`` write and validate the RayCluster; without
    ``pool.address`` stop there with the commands that start it. Returns notes for the log / deck."""
    if cfg.pool.execution != "pool" or cfg.pool.kuberay is None:
        return []
    uri = write_raycluster(cfg)
    if cfg.pool.address is None:
        raise field_error(ConfigError, "pool.address", None, f"the address of the RayCluster written to {uri}",
                          f"kubectl apply -f {uri} (after copying it locally), wait for its head, then run with "
                          f"pool.address={client_address(cfg)}")
    return [f"RayCluster spec {uri} (apply with kubectl apply -f); attaching to {cfg.pool.address}"]
