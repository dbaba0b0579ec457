"""slurm_scripts/pcluster.yaml is a cluster AWS ParallelCluster accepts: its own config schema
(the marshmallow ClusterSchema that `pcluster create-cluster` loads a file with) reads it, with
the head node, a GPU queue with EFA and a placement group, and /fsx shared by every node; a
misspelt key is refused by the same schema. Offline: no AWS account, no AWS call.

aws-parallelcluster pins older attrs and packaging than the series' stack, so it lives in a venv
of its own (tests/pcluster_venv.py), built in the background from the run's start or by the
first test that needs it (about 30 s, once) and kept in .venv/aws-parallelcluster-VERSION:
tests/README.md says more.
"""
import json
import re
import subprocess
from pathlib import Path

import pytest

import pcluster_venv
from conftest import REPO

CONFIG = REPO / "slurm_scripts/pcluster.yaml"
SETUP_SCRIPT = REPO / "slurm_scripts/pcluster_node_setup.sh"
README = REPO / "slurm_scripts/README.md"
# What a user puts in place of each FILL_IN_ value: values of the shape AWS gives them (the
# schema checks subnet ids and bucket names by pattern, so "FILL_IN" itself is refused).
EXAMPLES = {
    "FILL_IN_REGION": "us-east-1",
    "FILL_IN_PUBLIC_SUBNET": "subnet-0123456789abcdef0",
    "FILL_IN_PRIVATE_SUBNET": "subnet-0fedcba9876543210",
    "FILL_IN_KEY_PAIR": "my-key",
    "FILL_IN_BUCKET": "my-bucket",
}

# Run in the aws-parallelcluster venv: load a config (JSON on stdin) with ClusterSchema and
# print what the tests check, or the schema's own error messages. pcluster reads the region
# from the environment (AWS_DEFAULT_REGION), as its CLI sets it from the file's Region.
LOAD = """
import json, sys
from marshmallow import ValidationError
from pcluster.schemas.cluster_schema import ClusterSchema
try:
    cluster = ClusterSchema(cluster_name="ddp-series").load(json.load(sys.stdin))
except ValidationError as e:
    print(json.dumps({"errors": e.messages}))
    sys.exit(0)
queue = cluster.scheduling.queues[0]
resource = queue.compute_resources[0]
print(json.dumps({
    "head_instance": cluster.head_node.instance_type,
    "key_name": cluster.head_node.ssh.key_name,
    "scheduler": cluster.scheduling.scheduler,
    "queue": queue.name,
    "instance": resource.instance_type,
    "max_count": resource.max_count,
    "efa": resource.efa.enabled,
    "placement_group": queue.networking.placement_group.enabled,
    "shared": [(s.mount_dir, type(s).__name__) for s in cluster.shared_storage],
    "scripts": [(a.script, a.args) for a in (cluster.head_node.custom_actions.on_node_configured,
                                             queue.custom_actions.on_node_configured)],
}))
"""


@pytest.fixture(scope="session")
def pcluster_python() -> Path:
    """The venv's interpreter (tests/pcluster_venv.py): built on first use, or by the build
    conftest.py started in the background, which this waits for."""
    error = pcluster_venv.build()
    if error:  # no registry reachable: say so rather than fail later
        pytest.skip(f"cannot install aws-parallelcluster: {error}")
    return pcluster_venv.PYTHON


def load(python: Path, text: str) -> dict:
    """The config `text` with every FILL_IN_ value filled in, as ClusterSchema loads it."""
    import yaml  # hydra's dependency, in the series' requirements

    for placeholder, example in EXAMPLES.items():
        text = text.replace(placeholder, example)
    proc = subprocess.run([str(python), "-c", LOAD], input=json.dumps(yaml.safe_load(text)),
                          capture_output=True, text=True, timeout=120,
                          env={"AWS_DEFAULT_REGION": EXAMPLES["FILL_IN_REGION"],
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_schema_accepts_the_cluster_as_described(pcluster_python):
    cluster = load(pcluster_python, CONFIG.read_text())
    assert "errors" not in cluster, cluster
    assert cluster == {
        "head_instance": "c5.2xlarge", "key_name": "my-key", "scheduler": "slurm",
        "queue": "gpu", "instance": "p4d.24xlarge",
        # sbatch_run.sh asks for 2 nodes: the queue must be able to start them.
        "max_count": 2, "efa": True, "placement_group": True,
        "shared": [["/fsx", "SharedFsxLustre"]],
        "scripts": [[f"s3://my-bucket/{SETUP_SCRIPT.name}", ["head"]],
                    [f"s3://my-bucket/{SETUP_SCRIPT.name}", ["compute"]]],
    }
    # The script knows both roles: the head node also switches pyxis on for the cluster.
    setup = SETUP_SCRIPT.read_text()
    assert 'role="${1:?usage: pcluster_node_setup.sh head|compute}"' in setup
    assert 'if [ "$role" = head ]; then' in setup
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", (REPO / "slurm_scripts/sbatch_run.sh")
                      .read_text(), re.M)
    assert int(nodes.group(1)) <= cluster["max_count"]


def test_the_schema_refuses_a_misspelt_key(pcluster_python):
    # The same check is what makes the test above mean something: unknown keys are errors.
    text = CONFIG.read_text().replace("KeyName:", "KeyNmae:")
    assert load(pcluster_python, text) == {
        "errors": {"HeadNode": {"Ssh": {"KeyNmae": ["Unknown field."]}}}}


def test_every_value_to_fill_in_is_explained_in_the_readme():
    in_config = set(re.findall(r"FILL_IN_[A-Z_]+", CONFIG.read_text()))
    assert in_config == set(EXAMPLES)
    explained = README.read_text()
    for placeholder in in_config:
        assert f"`{placeholder}`" in explained, f"slurm_scripts/README.md: explain {placeholder}"
