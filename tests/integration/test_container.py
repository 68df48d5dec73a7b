"""The container image (deploy/container/): the image the Kubernetes manifests name, run under
podman: its synchronizer with the synchronizer manifest's command, token file and checkpoint
volume, and one island of its own (torchrun and examples/train_lm.py) against it.

The image is built by ``bash deploy/container/build.sh`` and tagged with a hash of what goes into
it. The test runs the image of the current sources: where it is missing it builds it if the slow
parts are cached (the base and the dependencies' wheels: a code change costs seconds), or builds
it from scratch (3-6 minutes here) with DILOCO_BUILD_IMAGE=1; else it skips, saying how."""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.deploy.runs import island_row, outer_steps

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "container" / "build.sh"
MANIFESTS = ROOT / "deploy" / "kubernetes"
BUILD_SECONDS = 900  # from scratch: debootstrap, about 250 MB of wheels, the install (3-6 minutes here)
LIMIT = 16384  # open files and processes in a container: podman's default (the maximum) may not be settable


def _containers(kind: str) -> list[dict]:
    """The containers of every ``kind`` object in deploy/kubernetes/."""
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            if obj["kind"] == kind:
                found += obj["spec"]["template"]["spec"]["containers"]
    return found


def _image_tag() -> str:
    out = subprocess.run(["bash", str(BUILD), "--print-tag"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_the_manifests_name_the_image_the_build_makes():
    repository = _image_tag().split(":")[0]
    images = {c["image"] for kind in ("Deployment", "Job") for c in _containers(kind)}
    assert images == {f"{repository}:latest"}, f"deploy/kubernetes/ names {images}; build.sh tags {repository}:latest"


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def _image(tmp_path: Path) -> str:
    """The image of the current sources, built here if that is cheap or asked for; else a skip."""
    if not shutil.which("podman"):
        pytest.skip("podman is not installed (apt-get install -y podman buildah debootstrap)")
    image = f"localhost/{_image_tag()}"
    if _podman("image", "exists", image).returncode == 0:
        return image
    how = f"build it with `bash {BUILD.relative_to(ROOT)}` (3-6 minutes the first time, seconds after a code change)"
    if not shutil.which("buildah"):
        pytest.skip(f"the image {image} is not built and buildah is missing (apt-get install -y buildah debootstrap): "
                    f"{how}")
    from_scratch = os.environ.get("DILOCO_BUILD_IMAGE") == "1"
    # the package's wheel is built by this interpreter; pip's and buildah's scratch files go with tmp_path
    env = dict(os.environ, PYTHON=os.environ.get("PYTHON", sys.executable), TMPDIR=str(tmp_path))
    build = subprocess.run(["bash", str(BUILD)] + ([] if from_scratch else ["--if-cached"]), capture_output=True,
                           text=True, env=env, timeout=BUILD_SECONDS)
    if build.returncode == 3 and not from_scratch:
        pytest.skip(f"the image {image} is not built, nor its slow parts cached ({build.stderr.strip()}): {how}, "
                    "or set DILOCO_BUILD_IMAGE=1 to build it in the test")
    assert build.returncode == 0, f"{BUILD.relative_to(ROOT)} failed:\n{build.stdout}{build.stderr}"
    return image


def _run_flags(image: str) -> list[str]:
    """Flags podman needs here to start a container: limits it may set, and runc where crun cannot
    run (crun refuses a host whose cgroup v2 hierarchy holds controllers beside v1's). A skip naming
    every error where nothing starts one."""
    limits = []
    for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(which)[1]
        value = LIMIT if hard == resource.RLIM_INFINITY else min(hard, LIMIT)
        limits.append(f"--ulimit={name}={value}:{value}")
    errors = []
    for runtime in ([], ["--runtime=runc"]):
        if runtime and not shutil.which("runc"):
            errors.append("runc: not installed (apt-get install -y runc)")
            continue
        probe = _podman("run", "--rm", *limits, *runtime, image, "true")
        if probe.returncode == 0:
            return limits + runtime
        errors.append(f"{runtime[0] if runtime else 'the default runtime'}: {probe.stderr.strip()}")
    pytest.skip(f"podman cannot run a container here: {'; '.join(errors)}")


@pytest.mark.slow
@pytest.mark.timeout(BUILD_SECONDS + 600)
def test_the_image_runs_the_synchronizer_and_an_island_that_trains_against_it(tmp_path):
    image = _image(tmp_path)
    flags = _run_flags(image)
    [sync] = _containers("Deployment")
    [island] = _containers("Job")
    mounts = {m["name"]: m["mountPath"] for m in sync["volumeMounts"]}
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    token.chmod(0o600)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    name = f"diloco-test-{uuid.uuid4().hex[:8]}"
    try:
        # the manifest's command and arguments as written; ":U" gives the volumes to the image's user, as fsGroup does
        started = _podman("run", "-d", "--name", name, *flags, "-e", "OMP_NUM_THREADS=1",
                          "-v", f"{token}:{mounts['token']}/token:ro,U", "-v", f"{checkpoints}:{mounts['checkpoints']}:U",
                          image, *sync["command"], *sync["args"])
        assert started.returncode == 0, started.stderr
        port = sync["ports"][0]["containerPort"]
        env = {e["name"]: e.get("value") for e in island["env"]}
        env.update(DILOCO_SYNCHRONIZER=f"127.0.0.1:{port}", DILOCO_NUM_ISLANDS="1", DILOCO_NUM_NODES="1",
                   DILOCO_TOKEN=token.read_text().strip(), OMP_NUM_THREADS="1")
        script = island["args"][island["args"].index("examples/train_lm.py"):]  # the script and its arguments
        # one island of one node, in the synchronizer's network namespace (a pod's loopback); it waits for the
        # synchronizer to listen (join_wait)
        trained = _podman("run", "--rm", "--name", f"{name}-island", *flags, "--network", f"container:{name}",
                          *[f"--env={k}={v}" for k, v in env.items()],
                          image, "torchrun", "--standalone", "--nproc-per-node", "1", *script, timeout=400)
        assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
        assert "final val_loss" in trained.stdout, trained.stdout[-3000:]

        status = _podman("exec", name, "lightning-diloco", "status", f"127.0.0.1:{port}", "--token-file",
                         f"{mounts['token']}/token")
        assert status.returncode == 0, status.stdout + status.stderr
        row = island_row(status.stdout, 0)
        assert int(row["steps"]) == int(script[script.index("--steps") + 1]) and int(row["accepted"]) > 0, status.stdout
        assert outer_steps(status.stdout) > 0 and "refused {}" in status.stdout, status.stdout

        stopped = _podman("stop", "--time", "60", name, timeout=120)  # SIGTERM: the final checkpoint
        assert stopped.returncode == 0, stopped.stderr
        logs = _podman("logs", name).stderr
        assert "final checkpoint" in logs, logs[-3000:]
        assert list(checkpoints.rglob("synchronizer-*.pt")), f"no checkpoint on the volume; the log:\n{logs[-3000:]}"
        print(f"container: {outer_steps(status.stdout)} outer steps, {row['accepted']} contributions accepted, "
              f"{row['steps']} island steps ({image})")
    finally:
        _podman("rm", "--force", "--ignore", "--time", "0", name, f"{name}-island")  # --ignore: the island is gone (--rm)
