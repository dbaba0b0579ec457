"""05_mingpt refuses bad input with one `error:` line: config mistakes, unusable data files, and
snapshots that are corrupt or belong to another model (which are never overwritten).

The slowest tests (many launches each) have `slowest` in their names.
"""

from pathlib import Path

import fsspec
import pytest
import torch
from omegaconf import OmegaConf

from mingpt_helpers import copy_mingpt, forked_peer, script_in_process, tiny
from step_helpers import node_envs


@pytest.fixture
def main_py(mingpt_modules, mingpt):
    """`python main.py ARGS` in the private 05_mingpt copy, run in this process."""
    return lambda *args, **env: script_in_process(mingpt_modules["main"], mingpt, *args, **env)


@pytest.fixture
def sample_py(mingpt_modules, mingpt):
    return lambda *args: script_in_process(mingpt_modules["sample"], mingpt, *args)


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt_errors"))


def one_error_line(proc, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("overrides, fragments", [
    (["trainer_config.batch_size=-1"], ["trainer_config.batch_size must be a positive integer"]),
    (["trainer_config.distributed_method=zero3"], ["one of ddp, fsdp", "'zero3'"]),
    (["trainer_config.precision=fp8"], ["one of fp32, bf16, fp16"]),
    (["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=3",
      "gpt_config.n_embd=32"], ["n_embd (32) must be divisible by n_head (3)"]),
    (["gpt_config.model_type=gpt-huge"], ["unknown model_type 'gpt-huge'", "gpt-nano"]),
    (["trainer_config.foo=1"], ["unknown key trainer_config.foo", "batch_size", "snapshot_path"]),
    (["+trainer_config.foo=1"], ["unknown key trainer_config.foo", "batch_size"]),
    (["bogus=1"], ["unknown key bogus", "trainer_config"]),
    (["gpt_config.vocab_size=3"], ["unknown key gpt_config.vocab_size"]),
    (["trainer_config.max_steps=many"], ["trainer_config.max_steps", "Integer"]),
    (["trainer_config.cpu_offload=true"], ["cpu_offload", "distributed_method=fsdp"]),
    (["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2",
      "trainer_config.async_save=true"], ["async_save must be False with tp_size > 1"]),
    (["trainer_config.comm_hook=powersgd"], ["one of none, fp16, bf16 (powersgd's "
                                             "per-bucket state cannot resume exactly"]),
    (["optimizer_config.betas=[0.9]"], ["optimizer_config.betas must be two numbers"]),
    (["optimizer_config.lr=0"], ["optimizer_config.lr must be > 0"]),
    (["data_config=nope"], ["data_config/nope.yaml", "char"]),
    (["trainer_config.batch_size=["], ["no viable alternative"]),
    # Experts (MOE.md): each rank holds n_expert / ep_size of them; top-k picks among them.
    (["gpt_config.n_expert=4", "trainer_config.ep_size=3"],
     ["trainer_config.ep_size must be a divisor of gpt_config.n_expert=4", "got 3"]),
    (["gpt_config.n_expert=4", "gpt_config.expert_top_k=5"],
     ["expert_top_k must be between 1 and n_expert (4), got 5"]),
    (["trainer_config.ep_size=2"], ["ep_size must be 0 or 1 for a dense model"]),
    (["gpt_config.n_expert=4", "trainer_config.ep_size=2", "trainer_config.distributed_method=dp"],
     ["distributed_method=dp (nn.DataParallel, one process) combines with no other axis, got "
      "ep_size=2"]),
    (["gpt_config.n_expert=4", "trainer_config.ep_size=2",
      "trainer_config.distributed_method=zero"], ["zero cannot take ep_size=2"]),
    (["gpt_config.n_expert=4", "trainer_config.ep_size=2", "trainer_config.distributed_method=fsdp",
      "trainer_config.tp_size=2"], ["ep_size=2 with tensor parallelism (tp_size=2)"]),
    (["gpt_config.n_expert=4", "trainer_config.ep_size=2", "trainer_config.cp_size=2"],
     ["ep_size=2 with cp_size=2"]),
    (["gpt_config.n_expert=4", "trainer_config.ep_size=2", "trainer_config.distributed_method=pp"],
     ["ep_size=2 splits the data-parallel ranks, and distributed_method=pp has none"]),
    (["gpt_config.n_expert=4", "trainer_config.distributed_method=fsdp_tp"],
     ["a layout without tensor parallelism for a MoE model"]),
    # The feature matrix's compiled runs count their graphs: this one compiled none.
    (["gpt_config.n_expert=4", "trainer_config.compile=true",
      "trainer_config.activation_checkpointing=true"],
     ["trainer_config.compile must be False with activation_checkpointing for a MoE model",
      "got True"]),
])
def test_config_mistakes_are_one_line(mingpt_modules, overrides, fragments):
    config = mingpt_modules["config"]
    with pytest.raises(ValueError) as info:
        config.load(overrides)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_valid_overrides_pass(mingpt_modules):
    mingpt_modules["config"].load(
        tiny("trainer_config.distributed_method=fsdp", "trainer_config.precision=bf16",
             "trainer_config.cpu_offload=True", "optimizer_config.betas=[0.8,0.99]"))


@pytest.mark.parametrize("args, fragments", [
    (["trainer_config.batch_size=-1"], ["trainer_config.batch_size must be a positive integer"]),
    (["trainer_config.foo=1"], ["unknown key trainer_config.foo"]),
])
def test_main_py_config_errors_create_nothing(mingpt, main_py, args, fragments):
    runs = set(mingpt.glob("runs/*"))
    proc = main_py(*args)
    one_error_line(proc, *fragments)
    assert set(mingpt.glob("runs/*")) == runs  # checked before hydra makes a run directory


def test_char_dataset_split_and_vocab(mingpt_modules, tmp_path):
    char_dataset = mingpt_modules["char_dataset"]
    text = "hello world, hello GPT! " * 20
    with fsspec.open("memory://mingpt/text.txt", "w") as f:  # any fsspec URL works
        f.write(text)
    cfg = OmegaConf.create({"path": "memory://mingpt/text.txt", "train_fraction": 0.9})
    train, val, meta = char_dataset.build_datasets(cfg, block_size=8, seed=0)
    assert meta["kind"] == "char" and meta["itos"] == sorted(set(text))
    assert meta["vocab_size"] == len(meta["itos"]) and meta["block_size"] == 8
    decode = "".join
    n_train = int(len(text) * 0.9)
    # The first 90% trains, the rest validates: no validation character is ever trained on.
    assert len(train) == n_train - 8 and len(val) == len(text) - n_train - 8
    x, y = train[3]
    assert x.shape == y.shape == (8,) and x.dtype == torch.long
    assert decode(meta["itos"][i] for i in x) == text[3:11]
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one
    xv, _ = val[0]
    assert decode(meta["itos"][i] for i in xv) == text[n_train:n_train + 8]
    # Deterministic: a second build (another rank) gets exactly the same split.
    train2, val2, meta2 = char_dataset.build_datasets(cfg, block_size=8, seed=123)
    assert meta2 == meta and torch.equal(train2.tokens, train.tokens)


@pytest.mark.parametrize("content, block_size, fragment", [
    (None, 8, "data file not found"),
    (b"", 8, "is empty"),
    (b"caf\xe9 latin-1", 8, "is not UTF-8 text"),
    (b"short text", 8, "must be smaller than each split"),
])
def test_char_dataset_bad_files(mingpt_modules, tmp_path, content, block_size, fragment):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    cfg = OmegaConf.create({"path": str(path), "train_fraction": 0.9})
    with pytest.raises(ValueError, match=fragment):
        mingpt_modules["char_dataset"].build_datasets(cfg, block_size=block_size, seed=0)


def test_main_py_missing_data_file(main_py):
    proc = main_py("data_config.path=no/such.txt", "run_name=nodata")
    one_error_line(proc, "data file not found", "no/such.txt")


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its path there: a snapshot, byte for byte."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def test_corrupt_and_incompatible_snapshots_are_refused_and_kept(mingpt, main_py, sample_py):
    args = tiny("trainer_config.max_steps=2", "trainer_config.sample_tokens=0")
    assert main_py(*args, "run_name=ok", "trainer_config.snapshot_path=ddp_snap").returncode == 0
    assert main_py(*args, "run_name=ok2", "trainer_config.distributed_method=fsdp",
                   "trainer_config.snapshot_path=fsdp_snap").returncode == 0
    ddp, fsdp = mingpt / "ddp_snap", mingpt / "fsdp_snap"
    good = contents(ddp)
    # Another model: refused before anything is loaded or written.
    wider = [a.replace("n_embd=32", "n_embd=64") for a in args]
    proc = main_py(*wider, "run_name=e1", "trainer_config.snapshot_path=ddp_snap")
    one_error_line(proc, "holds a different model", "n_embd=32 there, 64 here")
    assert contents(ddp) == good
    # fsdp's snapshot under zero: ZeRO reads it (by parameter name, shards.dcp_state), and
    # with no step left to train it leaves the shards as they were.
    before = sorted(p.name for p in fsdp.rglob("*"))
    proc = main_py(*args, "run_name=e2", "trainer_config.distributed_method=zero",
                   "trainer_config.snapshot_path=fsdp_snap")
    assert proc.returncode == 0 and "resumed from fsdp_snap at step 2" in proc.stdout, proc.stdout
    assert sorted(p.name for p in fsdp.rglob("*")) == before
    # Another optimizer: AdamW's moments are no state for Muon (mingpt/muon.py).
    proc = main_py(*args, "run_name=e5", "optimizer_config.name=muon",
                   "trainer_config.snapshot_path=ddp_snap")
    one_error_line(proc, "snapshot ddp_snap holds adamw's optimizer state, not muon's",
                   "set optimizer_config.name=adamw")
    assert contents(ddp) == good
    # A truncated train_state.pt.
    state = ddp / "step_00000002" / "train_state.pt"
    state.write_bytes(good["step_00000002/train_state.pt"][:200])
    proc = main_py(*args, "run_name=e3", "trainer_config.snapshot_path=ddp_snap")
    one_error_line(proc, "cannot load snapshot", "corrupt")
    assert contents(ddp) == {**good, "step_00000002/train_state.pt": state.read_bytes()}
    # A damaged shard file.
    shard = fsdp / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = main_py(*args, "run_name=e4", "trainer_config.distributed_method=fsdp",
                   "trainer_config.snapshot_path=fsdp_snap")
    one_error_line(proc, "cannot load sharded snapshot", "corrupt")
    assert len(shard.read_bytes()) == 100
    # sample.py: the same checks, the same single line.
    proc = sample_py("--snapshot", "ddp_snap")
    one_error_line(proc, "cannot load snapshot")
    proc = sample_py("--snapshot", "nothing/here")
    one_error_line(proc, "no snapshot at nothing/here")


def test_device_cuda_without_a_gpu_is_an_error(mingpt_modules):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: trainer_config.device=cuda is valid here")
    with pytest.raises(ValueError, match="trainer_config.device must be auto or cpu"):
        mingpt_modules["config"].load(["trainer_config.device=cuda"])


def test_an_epoch_too_small_for_one_step_is_one_error_line(main_py, tmp_path):
    # 100 characters, block 8: 82 training samples, fewer than one step of 16 x 6 needs. This
    # used to print one val loss and then loop forever.
    (tmp_path / "t.txt").write_text("abcdefghij" * 10)
    proc = main_py(f"data_config.path={tmp_path / 't.txt'}", "gpt_config.block_size=8",
                   "trainer_config.grad_accum_steps=6", "trainer_config.max_steps=5",
                   "trainer_config.eval_batches=1", "run_name=small")
    one_error_line(proc, "each rank gets 82 samples per epoch",
                   "one step needs batch_size × grad_accum_steps = 16 × 6 = 96")
    assert "val loss" not in proc.stdout  # refused before any work


@pytest.mark.timeout(180, method="thread")  # node a waits in C++ (in this process) for node b
def test_nodes_without_shared_storage_fail_with_one_line(mingpt_modules, tmp_path):
    # Two "nodes" on this machine, each in its own folder: only node a has a snapshot there.
    # Node b's worker is a process (forked), node a's runs here, each with the variables
    # torchrun gives the one worker of a node (what is checked is the workers' agreement, not
    # torchrun).
    nodes = [copy_mingpt(tmp_path / name) for name in ("a", "b")]
    args = tiny("run_name=shared", "trainer_config.max_steps=2", "trainer_config.sample_tokens=0")
    assert script_in_process(mingpt_modules["main"], nodes[0], *args).returncode == 0
    env = node_envs(2)
    with forked_peer(nodes[1], "main.py", args, env[1]) as node_b:
        node_a = script_in_process(mingpt_modules["main"], nodes[0], *args, **env[0])
        node_b.wait(timeout=120)
    assert node_a.returncode != 0 and node_b.returncode != 0
    outputs = [(node_a.stdout, node_a.stderr),
               tuple((nodes[1] / f"peer.{kind}").read_text() for kind in ("out", "err"))]
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error")]
    # Printed once on each node (its LOCAL_RANK 0), the same line: every rank agreed on it
    # (each names its own run folder: here the two "nodes" are two folders of one machine).
    assert len(errors) == 2, outputs
    assert errors[0].replace(str(nodes[0]), str(nodes[1])) == errors[1]
    assert errors[0] in node_a.stderr and not any("Traceback" in err for _, err in outputs)
    assert "holds a snapshot for ranks [" in errors[0]
    assert "storage all nodes share" in errors[0]
    assert "val loss" not in "".join(out for out, _ in outputs)  # refused before any training


@pytest.mark.timeout(180, method="thread")  # node a waits in C++ (in this process) for node b
def test_a_data_error_on_another_node_is_printed_and_stops_every_node(mingpt_modules, tmp_path):
    # Node b has no data file on its own storage. It used to exit 2 without a word (only
    # global rank 0 printed), while node a went on into DDP's first broadcast and failed there
    # with gloo's "Connection closed by peer" traceback (NCCL waits for its timeout instead).
    nodes = [copy_mingpt(tmp_path / name) for name in ("a", "b")]
    (nodes[1] / "data/input.txt").unlink()
    args = tiny("run_name=local_data", "trainer_config.max_steps=2",
                "trainer_config.sample_tokens=0")
    env = node_envs(2)
    with forked_peer(nodes[1], "main.py", args, env[1]) as node_b:
        node_a = script_in_process(mingpt_modules["main"], nodes[0], *args, **env[0])
        node_b.wait(timeout=120)
    b_err = (nodes[1] / "peer.err").read_text()
    assert node_a.returncode == 2 and node_b.returncode == 2, (node_a.stderr, b_err)
    for stderr in (node_a.stderr, b_err):  # each node says it, in the same one line
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        assert lines[0].startswith("error: rank 1 on ") and "input.txt" in lines[0], lines[0]
    assert node_a.stderr.strip() == b_err.strip()
    assert "val loss" not in node_a.stdout  # stopped before any training
