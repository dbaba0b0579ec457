"""Snapshots on S3 (fsspec + s3fs) against a local moto server: save, kill, resume, sample, for
the ddp file and the fsdp (DCP) directory; credentials never appear in the output. S3 faults:
refused credentials, a missing bucket, an unreachable or silent endpoint each stop a run with
one `error:` line within seconds; an upload that fails midway leaves the previous snapshot.

The slowest tests (several launches each) have `slowest` in their names. The fault tests run
05's code in this process (no launch): only the kill needs a process of its own.
"""
import errno
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import fsspec
import pytest
import s3fs
import torch
import torch.distributed as dist

from conftest import PYTHON, free_port, run
from mingpt_helpers import copy_mingpt, script_in_process, tiny

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
    # fsspec keeps one S3FileSystem per set of arguments for the life of the process, and it
    # keeps the endpoint it was made with: without this, a test file that reads snapshots in
    # this process after another file's server had gone (both in one xdist worker) asked the
    # dead one ("Could not connect to the endpoint URL").
    s3fs.S3FileSystem.clear_instance_cache()
    yield env
    s3fs.S3FileSystem.clear_instance_cache()
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt_s3"))


def s3(env: dict) -> s3fs.S3FileSystem:
    """A filesystem on the moto server for the test's own looks (its listing cache off)."""
    # Its own instance (skip_instance_cache), never the cached one 05's code configures.
    return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                             endpoint_url=env["AWS_ENDPOINT_URL"], use_listings_cache=False,
                             skip_instance_cache=True)


def no_credentials(*procs: subprocess.CompletedProcess) -> None:
    for proc in procs:
        assert SECRET not in proc.stdout + proc.stderr
        assert KEY_ID not in proc.stdout + proc.stderr


# One layout: every layout writes the same format (fsdp's shards on S3: the feature matrix).
@pytest.mark.parametrize("method", ["ddp"])
def test_snapshot_on_s3_saves_survives_a_kill_resumes_and_samples_slowest(mingpt, s3_env, aws,
                                                                           mingpt_modules,
                                                                           method):
    url = f"s3://mingpt/{method}/snapshot"
    args = tiny(f"trainer_config.distributed_method={method}",
                f"trainer_config.snapshot_path={url}", "trainer_config.save_every=2",
                "trainer_config.max_steps=6", "trainer_config.sample_tokens=0")
    # SIGKILLed (faults.py) while saving step 4, once step 4 is written and before its commit,
    # as the OOM killer or a lost node would: the snapshot on S3 must still be step 2's.
    first = run([PYTHON, "main.py", *args, f"run_name={method}1"], cwd=mingpt, check=False,
                FAULT_AT_SAVE="4", **s3_env)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert f"step 2: snapshot saved to {url}" in first.stdout
    assert "FAULT_AT_SAVE=4: killing this worker" in first.stdout
    fs = s3(s3_env)
    # Step 4's shards were all written, but `latest` still names step 2.
    assert fs.cat_file(f"mingpt/{method}/snapshot/latest") == b"step_00000002"
    steps = {o.split("/")[3] for o in fs.find(f"mingpt/{method}") if "/step_" in o}
    assert steps == {"step_00000002", "step_00000004"}
    # The resume and the sample need no fresh process (the kill did): run in this one.
    second = script_in_process(mingpt_modules["main"], mingpt, *args, f"run_name={method}2")
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed from {url} at step 2 (epoch 0)" in second.stdout
    assert "step 6: snapshot saved" in second.stdout
    objects = fs.find(f"mingpt/{method}")
    # Step 4 (the killed save's leftovers, then its redo) is kept beside step 6.
    assert fs.cat_file(f"mingpt/{method}/snapshot/latest") == b"step_00000006"
    assert {o.split("/")[3] for o in objects if "/step_" in o} == {"step_00000004",
                                                                   "step_00000006"}
    assert f"mingpt/{method}/snapshot/step_00000006/train_state.pt" in objects
    sample = script_in_process(mingpt_modules["sample"], mingpt, "--snapshot", url, "--prompt",
                               "KING:", "--num_tokens", "12")
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("KING:") and len(sample.stdout.rstrip("\n")) == 5 + 12
    assert "(dcp, step 6, " in sample.stderr
    no_credentials(first, second, sample)


# --- faults, in this process --------------------------------------------------------------------

@pytest.fixture
def aws(s3_env, monkeypatch):
    """The moto server's AWS_* settings in this process's environment (botocore reads them
    when s3fs creates its client), fresh s3fs instances, and fsspec's own s3 config empty."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {})
    s3fs.S3FileSystem.clear_instance_cache()  # a cached one keeps its endpoint and settings
    yield s3_env
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def moto_auth(s3_env):
    """Turns on moto's authentication: every request then needs an access key that its IAM
    knows, and the test keys are none (so "wrong credentials"). Always turned off again."""
    def switch(on: bool) -> None:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(urllib.request.Request(
            f"{s3_env['AWS_ENDPOINT_URL']}/moto-api/reset-auth", data=b"0" if on else b"inf",
            method="POST", headers={"Content-Type": "text/plain"}))
    yield switch
    switch(False)


@pytest.fixture
def silent_endpoint():
    """A TCP port that accepts connections and never answers (a hung proxy or server)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


UNREACHABLE = "check AWS_ENDPOINT_URL ({endpoint}) and the network (gave up after {n} attempts: " \
              "AWS_MAX_ATTEMPTS)"


@pytest.mark.parametrize("fault", ["refused_credentials", "missing_bucket", "refused_endpoint",
                                   "silent_endpoint"])
def test_s3_fault_is_one_error_line_within_seconds(mingpt_modules, mingpt, aws, moto_auth,
                                                   silent_endpoint, fault, monkeypatch):
    """Each stops the run before training, when 05 first looks for the snapshot. Before these
    bounds: the refused endpoint took 26 s and a traceback, the silent one 14 minutes."""
    url, env = "s3://mingpt/faults/snapshot", {}
    if fault == "refused_credentials":
        moto_auth(True)
        want = ("PermissionError: Forbidden; check the credentials (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and that they may read and write there")
    elif fault == "missing_bucket":
        url = "s3://no-such-bucket/snapshot"
        want = ("FileNotFoundError: bucket 'no-such-bucket' does not exist; create the bucket, "
                "or set trainer_config.snapshot_path to an existing one")
    elif fault == "refused_endpoint":  # nothing listens there: botocore's 3 default attempts
        endpoint = env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
        want = (f'EndpointConnectionError: Could not connect to the endpoint URL: "{endpoint}/'
                f'mingpt"; {UNREACHABLE.format(endpoint=endpoint, n=3)}')
    else:  # the user's settings bound it: 2 attempts of 1 s (the defaults: 3 of 15 s)
        endpoint = env["AWS_ENDPOINT_URL"] = silent_endpoint
        env["AWS_MAX_ATTEMPTS"] = "2"
        monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 1}})
        want = (f'ReadTimeoutError: Read timeout on endpoint URL: "{endpoint}/mingpt"; '
                f'{UNREACHABLE.format(endpoint=endpoint, n=2)}')
    start = time.monotonic()
    proc = script_in_process(mingpt_modules["main"], mingpt, *tiny(
        f"trainer_config.snapshot_path={url}", f"run_name=fault_{fault}"), **env)
    elapsed = time.monotonic() - start
    # Exactly one stderr line: the fault and its fix (no warning, no traceback before it).
    assert (proc.returncode, proc.stderr.strip()) == (
        2, f"error: snapshot storage {url}: {want}"), proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "step 1/" not in proc.stdout
    no_credentials(proc)
    # The backoff between attempts is random, at most 1 s then 2 s; the rest is the model's
    # setup in this process on a busy machine.
    assert elapsed < 15, elapsed


@pytest.fixture
def flaky_upload(monkeypatch):
    """S3 uploads in parts of 5 MiB (S3's smallest; s3fs refuses smaller blocks), and the
    returned switch makes the upload of a part, or of an object under a key holding a given
    text, fail as a dropped connection would."""
    part = 5 * 2**20
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": part})
    monkeypatch.setattr(s3fs.core.S3File, "part_max", part)  # else one part of up to 5 GiB
    real, parts = s3fs.core.S3File._call_s3, []
    fail = {"part": None, "key": None, "nth": 1, "seen": 0}  # the nth write to a key, and on

    # Every request an open s3fs file makes (put_object, upload_part, complete_...) goes
    # through S3File._call_s3: failing it there is failing it on the wire, minus the wire.
    def call_s3(self, method, *args, **kwargs):
        if method == "upload_part":
            parts.append(kwargs["PartNumber"])
            if len(parts) == fail["part"]:
                raise ConnectionResetError(errno.ECONNRESET, "connection reset (injected)")
        if fail["key"] and fail["key"] in kwargs.get("Key", "") and method != "upload_part":
            fail["seen"] += 1
            if fail["seen"] >= fail["nth"]:
                raise ConnectionResetError(errno.ECONNRESET, "connection reset (injected)")
        return real(self, method, *args, **kwargs)
    monkeypatch.setattr(s3fs.core.S3File, "_call_s3", call_s3)
    yield part, parts, fail


def test_upload_failing_midway_leaves_the_previous_snapshot(mingpt_modules, aws, flaky_upload):
    storage, (part, parts, fail) = mingpt_modules["storage"], flaky_upload
    url, fs = "s3://mingpt/midway/snapshot", s3(aws)
    storage.write_bytes_atomic(url, b"the previous snapshot")
    data = bytes(range(256)) * (2 * part // 256) + b"tail"  # 3 parts: 5 MiB, 5 MiB, 4 bytes
    fail["part"] = 2
    with pytest.raises(ConnectionResetError):
        storage.write_bytes_atomic(url, data)
    # Without discard(), closing the file completed the upload with part 1 and the tail (as
    # part 2): a 5 MiB object that torch.load cannot read, in place of the snapshot.
    stored = fs.cat_file("mingpt/midway/snapshot")
    assert len(stored) == 21 and stored == b"the previous snapshot"
    assert parts == [1, 2]  # the failure came after part 1 was stored, not before
    uploads = fs.call_s3("list_multipart_uploads", Bucket="mingpt").get("Uploads", [])
    assert uploads == []  # aborted: no parts left behind to pay for
    fail["part"], parts[:] = None, []
    storage.write_bytes_atomic(url, data)  # no fault: the three parts, committed whole
    assert parts == [1, 2, 3] and fs.cat_file("mingpt/midway/snapshot") == data


def test_failed_sharded_save_leaves_latest_at_the_previous_step(mingpt_modules, aws,
                                                                flaky_upload):
    """DCP's shard writes are fsspec writes too: one failing mid-save is a SaveError with one
    line for main.py, and `latest` still names the previous step, which loads."""
    snapshot, fail = mingpt_modules["snapshot"], flaky_upload[2]
    url, fs = "s3://mingpt/sharded/snapshot", s3(aws)
    meta = {"model_config": {}, "data_meta": {"kind": "test"}}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        snapshot.save(url, model, optimizer, {"step": 2, **meta})
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer.step()  # step 4's weights differ
        fail["key"] = "step_00000004"
        with pytest.raises(mingpt_modules["errors"].SaveError) as error:
            snapshot.save(url, model, optimizer, {"step": 4, **meta})
        assert str(error.value) == (
            f"cannot save the snapshot to {url} (ConnectionResetError: [Errno 104] connection "
            "reset (injected); " + UNREACHABLE.format(endpoint=aws["AWS_ENDPOINT_URL"], n=3)
            + "); the previous snapshot, if any, is unchanged: fix what it says or set "
            "trainer_config.snapshot_path, then run again to resume")
        fail["key"] = None
        assert fs.cat_file("mingpt/sharded/snapshot/latest") == b"step_00000002"
        fresh = torch.nn.Linear(4, 2)
        state = snapshot.load(url, fresh, torch.optim.AdamW(fresh.parameters()), meta,
                              ())
        assert state["step"] == 2
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, saved[key]), key
    finally:
        dist.destroy_process_group()


def test_failed_save_on_s3_stops_the_run_with_one_line_and_keeps_step_2(
        mingpt_modules, mingpt, aws, flaky_upload):
    """main.py end to end, in this process: the step-4 save fails (the first write into step
    4's directory)."""
    fail, url, fs = flaky_upload[2], "s3://mingpt/save_fault/ddp", s3(aws)
    fail["key"], fail["nth"] = "step_00000004", 1
    proc = script_in_process(mingpt_modules["main"], mingpt, *tiny(
        f"trainer_config.snapshot_path={url}", "trainer_config.save_every=2",
        "trainer_config.max_steps=4", "trainer_config.sample_tokens=0", "run_name=save_fault"))
    assert f"step 2: snapshot saved to {url}" in proc.stdout
    reason = ("ConnectionResetError: [Errno 104] connection reset (injected); "
              + UNREACHABLE.format(endpoint=aws["AWS_ENDPOINT_URL"], n=3))
    # One line, exactly this up to main.py's own advice on what to do next.
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: cannot save the snapshot to {url} ({reason}); the "
                                  "previous snapshot"), proc.stderr
    assert fs.cat_file("mingpt/save_fault/ddp/latest") == b"step_00000002"
