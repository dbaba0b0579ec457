"""The VS Code debug configurations (.vscode/launch.json) start what they name: every program,
module, script and working folder exists, and 05's configurations pass main.py's own checks.
The container configuration attaches to docs/VSCODE.md's debugpy command (run here without Docker)
and follows torchrun into every rank, and its path mapping is the image's folder."""
import importlib.util
import json
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from dockerfile_parse import DockerfileParser

from conftest import PYTHON, REPO, child_env, free_port, run
from mingpt_helpers import copy_mingpt, tiny

LAUNCH = REPO / ".vscode/launch.json"
CONFIGS = json.loads(LAUNCH.read_text())["configurations"]
LAUNCHES = [c for c in CONFIGS if c["request"] == "launch"]
(ATTACH,) = [c for c in CONFIGS if c["request"] == "attach"]


def resolve(value: str) -> str:
    """VS Code's ${workspaceFolder}; ${file} (the open file) stands for step 01's train.py."""
    return value.replace("${workspaceFolder}", str(REPO)).replace(
        "${file}", str(REPO / "01_single_gpu/train.py"))


@pytest.mark.parametrize("config", LAUNCHES, ids=lambda c: c["name"])
def test_every_configuration_names_what_exists(config):
    assert config["type"] == "debugpy" and config["request"] == "launch"
    cwd = resolve(config["cwd"])
    assert (REPO / cwd).is_dir(), cwd
    assert resolve(config["python"]) == str(REPO / ".venv/bin/python")  # the Quickstart's venv
    if "program" in config:
        assert (REPO / resolve(config["program"])).is_file(), config["program"]
    else:  # torchrun as a module: the script it starts is relative to cwd
        assert importlib.util.find_spec(config["module"]) is not None, config["module"]
        script = next(a for a in config["args"] if not a.startswith("-"))
        assert (REPO / cwd / script).is_file(), script
        assert config["subProcess"], "torchrun's workers are child processes: debug them too"


@pytest.mark.parametrize("config", [c for c in LAUNCHES if "05_mingpt" in c["cwd"]],
                         ids=lambda c: c["name"])
def test_05_configurations_pass_main_pys_checks(config, tmp_path):
    # `--cfg job` composes and checks the overrides, then exits: a stale key fails here.
    overrides = [a for a in config["args"] if "=" in a and not a.startswith("-")]
    proc = run([PYTHON, "main.py", "--cfg", "job", *overrides], cwd=REPO / "05_mingpt")
    for override in overrides:
        key, value = override.split("=", 1)
        assert f"{key.rpartition('.')[2]}: {value}" in proc.stdout, (override, proc.stdout)


def container_debug_command() -> list[str]:
    """docs/VSCODE.md's `docker run ... python -m debugpy ...` line, split."""
    page = (REPO / "docs/VSCODE.md").read_text()
    (block,) = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    return shlex.split(block.replace("\\\n", " "))


def test_the_container_configuration_maps_the_images_folder_and_port():
    docker = container_debug_command()
    assert docker[:2] == ["docker", "run"]
    app = DockerfileParser(str(REPO / "Dockerfile")).structure
    (workdir,) = [i["value"] for i in app if i["instruction"] == "WORKDIR"]
    # The checkout is mounted where the image keeps the series, and that is what VS Code maps.
    assert docker[docker.index("-v") + 1] == f"$PWD:{workdir}"
    assert ATTACH["pathMappings"] == [{"localRoot": "${workspaceFolder}", "remoteRoot": workdir}]
    assert docker[docker.index("-w") + 1] == f"{workdir}/05_mingpt"
    # debugpy listens on every interface inside the container (Docker forwards to it there);
    # the port is published on the host's loopback only, where the configuration connects.
    listen = docker[docker.index("--listen") + 1]
    host_ip, host_port, container_port = docker[docker.index("-p") + 1].split(":")
    assert listen == f"0.0.0.0:{container_port}"
    assert ATTACH["connect"] == {"host": host_ip, "port": int(host_port)}
    assert ATTACH["subProcess"], "torchrun's workers are child processes: debug them too"


def dap_messages(sock: socket.socket) -> Iterator[dict]:
    """The Debug Adapter Protocol messages on `sock`: a Content-Length header, then JSON."""
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buffer += chunk
        header, buffer = buffer.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length: (\d+)", header).group(1))
        while len(buffer) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buffer += chunk
        yield json.loads(buffer[:length])
        buffer = buffer[length:]


def dap_session(port: int, attach: dict, seen: list[tuple[str, dict]]) -> None:
    """What VS Code does with the configuration: initialize, attach, configurationDone once the
    adapter is initialized; and for each `debugpyAttach` event (a child process, here a rank)
    a session of its own with the event's arguments, as VS Code opens one per process."""
    deadline = time.monotonic() + 60
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:  # debugpy not listening yet
            assert time.monotonic() < deadline, "debugpy never listened"
            time.sleep(0.2)
    children = []
    with sock:
        def request(seq: int, command: str, **arguments) -> None:
            body = json.dumps({"seq": seq, "type": "request", "command": command,
                               "arguments": arguments}).encode()
            sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

        request(1, "initialize", adapterID="debugpy", clientID="vscode")
        request(2, "attach", **attach)
        for message in dap_messages(sock):
            event = message.get("event")
            seen.append((event or message.get("command"), message.get("body") or {}))
            if event == "initialized":
                request(3, "configurationDone")
            elif event == "debugpyAttach":
                child = threading.Thread(target=dap_session, args=(port, message["body"], seen))
                child.start()
                children.append(child)
            elif event == "terminated":
                break
    for child in children:
        child.join()


def test_the_container_configuration_attaches_to_torchrun_and_every_rank(tmp_path):
    # docs/VSCODE.md's command as the container runs it: everything after the image name, in the
    # folder given by -w (05_mingpt), with a free loopback port and a tiny run.
    docker = container_debug_command()
    command = docker[docker.index("ddp-series") + 1:]
    port = free_port()
    command[command.index("0.0.0.0:5678")] = f"127.0.0.1:{port}"
    overrides = [a for a in command if "=" in a and not a.startswith("-")]
    script = command.index("main.py")
    command = [PYTHON if command[0] == "python" else command[0], *command[1:script + 1],
               *tiny("run_name=debug", f"run_dir={tmp_path / 'run'}",
                     "trainer_config.max_steps=2", "trainer_config.save_every=2")]
    assert {o.split("=")[0] for o in overrides} <= {"run_name", "trainer_config.max_steps"}
    nproc = int(next(a for a in command if a.startswith("--nproc_per_node=")).split("=")[1])
    server = subprocess.Popen(command, cwd=copy_mingpt(tmp_path), env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[tuple[str, dict]] = []
    attach = {k: v for k, v in ATTACH.items() if k not in ("name", "type", "request")}
    attach["connect"] = {"host": "127.0.0.1", "port": port}
    try:
        # --wait-for-client: nothing runs until the configuration has attached.
        dap_session(port, attach, seen)
        out, _ = server.communicate(timeout=180)
    finally:
        server.kill()
    assert server.returncode == 0, out[-3000:]
    processes = [body["name"] for event, body in seen if event == "process"]
    # torchrun itself, then one session per rank, each running main.py.
    assert processes[0].endswith("torch/distributed/run.py"), processes
    assert sorted(processes[1:]) == ["main.py"] * nproc, processes
    assert len([e for e, _ in seen if e == "debugpyAttach"]) == nproc
    assert "final val loss" in out
