"""Beyond one process: the trainer patch and the scoring path under FSDP2 and DDP, and ``rpa
train`` on two processes.

On CPU (gloo). ``accelerate launch`` starts several CPU processes only through MPI, so the
two-process run uses ``torch.distributed.run`` -- the launcher accelerate's multi-GPU configs
(``experiments/accelerate/``) call on GPU machines; TRL's Accelerator picks up its environment
the same way.
"""

import json
import socket

import pytest
import yaml

from tests.conftest import run_py, tail

FSDP_SCRIPT = """
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from rpa.measure.scoring import token_logps_and_entropy
from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import align_model
path = sys.argv[1]
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
aligned = NumericsConfig.from_dict({"regions": "all"})
align_model(ref, aligned), align_model(model, aligned)
ids = torch.randint(3, 500, (3, 14), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :4] = 0
mesh = init_device_mesh("cpu", (1,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
patched = lambda m: sorted(n for n, x in m.named_modules() if "forward" in x.__dict__)
with torch.no_grad():
    same = torch.equal(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
rows, head = [], model.lm_head
stock = head.forward
def recording(x):  # every call of the LM head: how many token rows it saw at once
    rows.append(x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1])
    return stock(x)
head.forward = recording
with torch.no_grad():
    a, _ = token_logps_and_entropy(model, ids, mask, 6, chunk_tokens=4)
    b, _ = token_logps_and_entropy(ref, ids, mask, 6, chunk_tokens=4)
loss = token_logps_and_entropy(model, ids, mask, 6, chunk_tokens=4)[0].sum()
loss.backward()
print(json.dumps({"wrapped": type(model).__name__, "same_logits": same, "same_logps": bool(torch.equal(a, b)),
                  "patched_equal": patched(model) == patched(ref), "patched": len(patched(model)),
                  "head_rows": rows, "restored": head.forward is recording,
                  "grads": all(p.grad is not None for p in model.parameters())}))
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_trainer_patch_survives_fsdp2_wrapping(tiny_dirs):
    proc = run_py(["-c", FSDP_SCRIPT, str(tiny_dirs["qwen3"]), free_port()], timeout=600)
    assert proc.returncode == 0, tail(proc)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["wrapped"].startswith("FSDP") and r["patched"] > 10 and r["patched_equal"], r
    assert r["same_logits"] and r["same_logps"] and r["grads"], r
    # scoring the sharded model runs the head in chunks inside its forward (after FSDP2 gathered
    # the parameters): 18 kept tokens -> chunks of at most 4 rows, never the whole batch at once
    assert r["head_rows"] and max(r["head_rows"]) <= 4 and r["restored"], r


DDP_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from rpa.measure.scoring import token_logps_and_entropy
from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import align_model
torch.manual_seed(0)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
align_model(model, NumericsConfig.from_dict({"regions": "all"}))  # BF16 compute from FP32 masters, as GRPO trains
ddp = torch.nn.parallel.DistributedDataParallel(model)
ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(rank))
mask = torch.ones_like(ids)
mask[1, :5] = 0
rows, stock = [], model.lm_head.forward
def recording(x):
    rows.append(x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1])
    return stock(x)
model.lm_head.forward = recording
with torch.no_grad():  # TRL's old-policy logprobs: the unwrapped model
    old, ent_old = token_logps_and_entropy(model, ids, mask, 7, 0.7, 2, True, chunk_tokens=5)
new, ent_new = token_logps_and_entropy(ddp, ids, mask, 7, 0.7, 2, True, chunk_tokens=5)  # the loss: the wrapper
new.sum().backward()
grads = torch.cat([p.grad.flatten() for p in model.parameters()])
gathered = [torch.empty_like(grads) for _ in range(2)]
dist.all_gather(gathered, grads)
open(f"{sys.argv[2]}/rank{rank}.json", "w").write(json.dumps({"rank": rank, "same": bool(torch.equal(old, new.detach()) and torch.equal(ent_old, ent_new.detach())),
                  "grads_synced": bool(torch.equal(gathered[0], gathered[1])), "head_rows": rows}))  # the ranks' prints would interleave
dist.destroy_process_group()
"""


def test_ddp_loss_and_old_logprobs_score_through_one_path(tiny_dirs, tmp_path):
    """Under DDP, TRL scores π_old with the unwrapped model and the loss's π with the wrapper:
    both go through the model's forward with the head chunked inside it, so π_old equals π
    bitwise before the update (the PPO ratio is exactly 1), and DDP still averages gradients."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
                   str(script), str(tiny_dirs["qwen3"]), str(tmp_path)], timeout=600)
    assert proc.returncode == 0, tail(proc)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1], tail(proc)
    for r in results:
        assert r["same"] and r["grads_synced"], r
        assert r["head_rows"] and max(r["head_rows"]) <= 5, r  # 4 x 7 kept tokens, chunks of <= 5


@pytest.mark.engine
def test_two_process_run_logs_each_step_once_with_gathered_mismatch(tiny_dirs, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": str(tiny_dirs["qwen3"]), "task": {"name": "synthetic-add", "num_prompts": 64, "max_operand": 9},
        "numerics": {"regions": "all"}, "steps": 3, "prompts_per_step": 4, "num_generations": 4,
        "learning_rate": 1.0e-3, "max_prompt_length": 32, "max_completion_length": 6, "checkpoint_every": 3,
        "warm_start": {"steps": 20, "learning_rate": 3.0e-3, "batch_size": 16}}))
    out = tmp_path / "run"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
                   "-m", "rpa.cli", "train", "--config", str(cfg), "--out", str(out)], timeout=900)
    assert proc.returncode == 0, tail(proc)
    assert "rpa train rank 1" in proc.stderr  # two processes ran
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # rank 0 alone writes, once per step
    for r in records:  # the mismatch covers both ranks' completions: 16 per step, not one rank's 8
        assert r["mismatch/tokens"] == pytest.approx(16 * r["completions/mean_length"]), r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert proc.stdout.count("rpa train: 3 logged steps") == 1


WAIT_SCRIPT = """
import json, os, sys, time
from datetime import timedelta
from types import SimpleNamespace
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=2))  # training's, short
    from rpa.train.ranks import evaluation_group, wait_for_rank0
    holder, got = SimpleNamespace(), {}
    training = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))  # as training's group, 2 s
    late = evaluation_group(1, SimpleNamespace())  # an eval_timeout_s of 1 s
    def evaluation(seconds, group):  # every rank has the group; rank 0 evaluates for `seconds`, then they meet
        t0 = time.time()
        if rank == 0:
            time.sleep(seconds)
        try:
            wait_for_rank0(group)
            return round(time.time() - t0, 1)
        except Exception as err:
            return type(err).__name__
    got["waited"] = evaluation(3.5, evaluation_group(30, holder))  # past the default group's 2 s
    got["again"] = evaluation(2.5, evaluation_group(30, holder))  # made once, used again
    got["one_group"] = evaluation_group(30, holder) is holder._rpa_eval_group
    got["timed_out"] = evaluation(2.5, late)  # past eval_timeout_s
    got["in_training_collective"] = evaluation(3.5, training)  # the wait it replaces
    time.sleep(4)  # every rank past its timeouts before the group goes
    json.dump(got, open(f"{out}.{rank}", "w"))
    os._exit(0)  # a group whose barrier timed out does not always tear down cleanly

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def test_the_other_ranks_wait_for_rank_0s_evaluation_past_the_groups_timeout(tmp_path):
    """Two CPU processes, a process group of 2 s: rank 0 evaluates for 3.5 s while rank 1 waits in
    wait_for_rank0 (30 s) and goes on; an evaluation past eval_timeout_s fails the wait; the control:
    waiting in a collective of the 2-s group (what the other ranks did before) fails."""
    out, script = tmp_path / "wait", tmp_path / "wait.py"
    script.write_text(WAIT_SCRIPT)  # a file: spawned processes import the worker from it
    proc = run_py([str(script), free_port(), str(out)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    rank0, rank1 = (json.loads((tmp_path / f"wait.{r}").read_text()) for r in (0, 1))
    assert isinstance(rank1["waited"], float) and rank1["waited"] >= 3.0, rank1
    assert isinstance(rank1["again"], float) and rank1["again"] >= 2.0, rank1
    assert isinstance(rank0["waited"], float) and isinstance(rank0["again"], float) and rank0["one_group"], rank0
    assert isinstance(rank1["timed_out"], str) and "Error" in rank1["timed_out"], rank1
    assert isinstance(rank1["in_training_collective"], str), rank1
