"""deploy/kubernetes/: the manifests are valid Kubernetes objects (the API's schema, strictly: an
unknown or misspelt field fails), they refer to each other by the right names, and the commands
their containers run are ones our CLI and torchrun accept."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_diloco.cli import build_parser
from lightning_diloco.synchronizer.main import run_config_from_args

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.37.0"  # the newest API version kubernetes-validate ships schemas for
# what the package and examples/train_lm.py read from an island's environment
ISLAND_VARIABLES = {"DILOCO_SYNCHRONIZER", "DILOCO_ISLAND", "DILOCO_NUM_ISLANDS", "DILOCO_TOKEN", "DILOCO_NUM_NODES",
                    "DILOCO_DEVICES", "DILOCO_STRATEGY", "DILOCO_CHECKPOINT_DIR"}


def _objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in MANIFESTS:
        for obj in yaml.safe_load_all(path.read_text()):
            objects[(obj["kind"], obj["metadata"]["name"])] = obj
    return objects


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schema(path):
    validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra) checks manifests "
                                   "against the Kubernetes API schemas it ships").validate
    objects = list(yaml.safe_load_all(path.read_text()))
    assert objects
    for obj in objects:
        validate(obj, KUBERNETES, strict=True)  # raises, naming the field, on anything the API would refuse


def test_the_manifests_refer_to_each_other_by_their_names():
    objects = _objects()
    deployment = objects[("Deployment", "diloco-synchronizer")]
    pod = deployment["spec"]["template"]
    service = objects[("Service", "diloco-synchronizer")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]] == [7470]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert all(("PersistentVolumeClaim", name) in objects for name in claims) and claims
    secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}

    jobs = [obj for (kind, _), obj in objects.items() if kind == "Job"]
    assert jobs
    for job in jobs:
        name, spec = job["metadata"]["name"], job["spec"]
        headless = objects[("Service", spec["template"]["spec"]["subdomain"])]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == {"job-name": name}
        [island] = spec["template"]["spec"]["containers"]
        env = {e["name"]: e for e in island["env"]}
        assert set(env) <= ISLAND_VARIABLES, set(env) - ISLAND_VARIABLES
        assert env["DILOCO_SYNCHRONIZER"]["value"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
        assert env["DILOCO_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] in secrets  # the synchronizer's token
        torchrun = _torchrun(island)
        # pod 0 of an indexed Job is <job>-0, named in DNS under the headless Service
        assert torchrun.rdzv_endpoint == f"{name}-0.{headless['metadata']['name']}:29400"
        assert int(torchrun.nnodes) == spec["completions"] == spec["parallelism"] == int(env["DILOCO_NUM_NODES"]["value"])
        assert spec["completionMode"] == "Indexed" and torchrun.rdzv_backend == "c10d"
        assert (ROOT / torchrun.training_script).is_file()


def test_the_synchronizer_container_runs_a_command_the_cli_accepts():
    [container] = _objects()[("Deployment", "diloco-synchronizer")]["spec"]["template"]["spec"]["containers"]
    assert container["command"][0] == "lightning-diloco"
    args = build_parser().parse_args(container["command"][1:] + container["args"])  # exits on an unknown flag
    run_config_from_args(args)  # the run settings are valid
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert args.host == "0.0.0.0" and Path(args.token_file).parent.as_posix() in mounts
    assert any(Path(args.checkpoint_dir).is_relative_to(m) for m in mounts)


def _torchrun(container):
    from torch.distributed.run import get_args_parser

    assert container["command"] == ["torchrun"]
    return get_args_parser().parse_args(container["args"])
