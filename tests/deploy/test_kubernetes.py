"""deploy/kubernetes/: the manifests are valid Kubernetes objects (the API's schema, strictly: an
unknown or misspelt field fails), they refer to each other by the right names, the commands their
containers run are ones our CLI and torchrun accept, and those containers, run as pods on hosts
made of network namespaces, form the run they describe."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_diloco.cli import build_parser
from lightning_diloco.synchronizer.main import run_config_from_args
from tests.deploy.hosts import wait_for_text
from tests.deploy.runs import island_row, outer_steps, run_island, stop_synchronizer

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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_containers_run_as_pods_form_the_run_the_manifests_describe(hosts_factory, clone, environment, tmp_path):
    """What the cluster would do, played on network namespaces: each pod a host with the pod's
    hostname and DNS names (``<job>-<k>.<subdomain>`` for the Job's pods, the Service's name for
    the synchronizer), each container's command, arguments and environment as the manifests write
    them, the Secret's token where they read it and each volume a folder (its mountPath mapped
    there). The image is this clone: its .venv's programs on the PATH, its folder the working
    directory."""
    objects = _objects()
    sync_pod = objects[("Deployment", "diloco-synchronizer")]["spec"]["template"]["spec"]
    [sync_container] = sync_pod["containers"]
    service = objects[("Service", "diloco-synchronizer")]
    [job] = [obj for (kind, _), obj in objects.items() if kind == "Job"]
    name, subdomain = job["metadata"]["name"], job["spec"]["template"]["spec"]["subdomain"]
    pods = [f"{name}-{k}" for k in range(job["spec"]["completions"])]
    sync_host = service["metadata"]["name"]
    hosts = hosts_factory([*pods, sync_host], aliases={pod: [f"{pod}.{subdomain}"] for pod in pods})
    token = secrets.token_hex(16)  # the Secret diloco-token
    image = dict(environment, PATH=f"{Path(sys.executable).parent}:{environment['PATH']}")

    volumes = {}
    for mount in sync_container["volumeMounts"]:
        folder = tmp_path / "volumes" / mount["name"]
        folder.mkdir(parents=True)
        [volume] = [v for v in sync_pod["volumes"] if v["name"] == mount["name"]]
        if "secret" in volume:
            (folder / "token").write_text(token + "\n")  # the Secret's one key, a file of that name
        volumes[mount["mountPath"]] = folder
    args = [_on_volumes(arg, volumes) for arg in sync_container["command"] + sync_container["args"]]
    sync_log = tmp_path / "synchronizer.log"
    sync = hosts.start(sync_host, args, sync_log, cwd=clone, env=image, start_new_session=True)
    wait_for_text(sync_log, "synchronizer listening on", sync, timeout=120)

    [container] = job["spec"]["template"]["spec"]["containers"]
    env = dict(image)
    for variable in container["env"]:
        env[variable["name"]] = variable["value"] if "value" in variable else token  # secretKeyRef: diloco-token
    logs = [tmp_path / f"{pod}.log" for pod in pods]
    port = service["spec"]["ports"][0]["port"]
    seconds = run_island(hosts, pods, container["command"] + container["args"], logs, sync_host, port, cwd=clone, env=env)

    status = subprocess.run(hosts.command(pods[1], ["lightning-diloco", "status", f"{sync_host}:{port}"]), cwd=clone,
                            env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    stop_synchronizer(sync, sync_log)
    island = island_row(status.stdout, int(env["DILOCO_ISLAND"]))
    assert island["procs"] == "2" and int(island["accepted"]) > 0 and outer_steps(status.stdout) > 0, status.stdout
    assert "refused {}" in status.stdout, status.stdout
    checkpoints = [folder for mount, folder in volumes.items() if mount == "/checkpoints"]
    assert checkpoints and any(checkpoints[0].rglob("*")), "the synchronizer wrote no checkpoint on its volume"
    print(f"Kubernetes island of 2 pods (deploy/kubernetes/): {outer_steps(status.stdout)} outer steps, "
          f"{island['accepted']} contributions accepted, {island['steps']} steps, {seconds:.1f} s from torchrun's start "
          "to both pods' exit")


def _on_volumes(arg: str, volumes: dict[str, Path]) -> str:
    """``arg`` with a path under a volume's mountPath moved to the volume's folder."""
    for mount, folder in volumes.items():
        if arg == mount or arg.startswith(mount + "/"):
            return str(folder) + arg[len(mount):]
    return arg
