"""Snapshots on S3 (fsspec + s3fs) against a local moto server: save, resume, sample, for the
ddp file and the fsdp (DCP) directory; credentials never appear in the output.

The slowest tests (several launches each) have `slowest` in their names.
"""
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import PYTHON, free_port, run
from mingpt_helpers import copy_mingpt, tiny

SECRET = "mingpt-test-secret-never-logged"
KEY_ID = "mingpt-test-key-id"


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on 127.0.0.1 (at most 10 minutes, even if pytest dies) and a bucket."""
    port = free_port()
    moto = str(Path(PYTHON).with_name("moto_server"))
    server = subprocess.Popen(["timeout", "600", moto, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + 60
    while True:
        try:
            direct.open(endpoint, timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.3)
    # The standard AWS variables: s3fs (botocore) reads them, nothing is configured in code.
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    direct.open(urllib.request.Request(f"{endpoint}/mingpt", method="PUT"))  # the bucket
    yield env
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt_s3"))


def s3_listing(env: dict, prefix: str) -> list[str]:
    code = ("import sys, s3fs; print('\\n'.join(sorted(s3fs.S3FileSystem().find(sys.argv[1]))))")
    return run([PYTHON, "-c", code, prefix], **env).stdout.split()


def no_credentials(*procs: subprocess.CompletedProcess) -> None:
    for proc in procs:
        assert SECRET not in proc.stdout + proc.stderr
        assert KEY_ID not in proc.stdout + proc.stderr


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_snapshot_on_s3_saves_resumes_and_samples_slowest(mingpt, s3_env, method):
    url = f"s3://mingpt/{method}/snapshot"
    args = tiny(f"trainer_config.distributed_method={method}",
                f"trainer_config.snapshot_path={url}", "trainer_config.save_every=2",
                "trainer_config.sample_tokens=0")
    first = run([PYTHON, "main.py", *args, "trainer_config.max_steps=4", f"run_name={method}1"],
                cwd=mingpt, **s3_env)
    assert f"step 4: snapshot saved to {url}" in first.stdout
    objects = s3_listing(s3_env, f"mingpt/{method}")
    if method == "ddp":
        assert objects == [f"mingpt/{method}/snapshot"]  # one object, no temporary left over
    else:  # the step-2 checkpoint was replaced by step 4; `latest` names the current one
        assert f"mingpt/{method}/snapshot/latest" in objects
        assert {o.split("/")[3] for o in objects if "/step_" in o} == {"step_00000004"}
        assert f"mingpt/{method}/snapshot/step_00000004/train_state.pt" in objects
    second = run([PYTHON, "main.py", *args, "trainer_config.max_steps=6", f"run_name={method}2"],
                 cwd=mingpt, **s3_env)
    assert f"resumed from {url} at step 4 (epoch 0)" in second.stdout
    assert "step 6: snapshot saved" in second.stdout
    sample = run([PYTHON, "sample.py", "--snapshot", url, "--prompt", "KING:", "--num-tokens",
                  "12"], cwd=mingpt, **s3_env)
    assert sample.stdout.startswith("KING:") and len(sample.stdout.rstrip("\n")) == 5 + 12
    assert f"({method}, step 6, " in sample.stderr
    no_credentials(first, second, sample)
