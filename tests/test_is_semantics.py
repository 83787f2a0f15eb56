"""Old logprobs from the sampler with an IS correction apply the correction twice: shown with
TRL's own GRPO loss on hand-made inputs, and refused by the run config; the dose grid neither
expands such cells nor lets its committed ones into a threshold."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rpa.train.config import TrainConfig, TrainConfigError


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss_grad(pi: torch.Tensor, old: torch.Tensor, is_ratio: torch.Tensor | None, advantages: torch.Tensor):
    """d loss / d log pi through TRL 1.16's GRPOTrainer._compute_loss (DAPO loss, token level)."""
    from trl import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    logp = pi.clone().requires_grad_(True)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    t.__dict__.update(top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
                      beta=0.0, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, use_vllm=True,
                      vllm_importance_sampling_correction=is_ratio is not None, aux_loss_enabled=False,
                      _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
                      args=SimpleNamespace(delta=None, steps_per_generation=1),
                      accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)))
    t.model = SimpleNamespace(training=True)
    b, n = pi.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, n, dtype=torch.long), "completion_mask": torch.ones(b, n),
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": torch.tensor(float(b * n))}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    t._compute_loss(None, inputs).backward()
    return logp.grad


def test_sampler_old_logprobs_with_tis_weight_the_update_twice():
    pi = torch.tensor([[-1.00, -2.00, -0.50]])
    mu = torch.tensor([[-1.05, -1.90, -0.52]])  # the sampler's logprobs: within the clip range of pi
    adv = torch.tensor([1.0])
    ratio = torch.exp(pi - mu)
    truncated = torch.clamp(torch.exp(pi - mu), max=2.0)  # TRL's TIS weight, old = the trainer's pi at sampling
    one = trl_loss_grad(pi, mu, None, adv)           # old = mu, IS off: the PPO ratio alone corrects for mu
    twice = trl_loss_grad(pi, mu, truncated, adv)     # what old_logprobs: sampler + TIS did
    once = trl_loss_grad(pi, pi, truncated, adv)      # old = pi (trainer) + TIS: TRL's own semantics
    torch.testing.assert_close(one, -adv * ratio / 3)
    torch.testing.assert_close(once, -adv * truncated / 3)
    torch.testing.assert_close(twice, one * truncated)  # (pi/mu) x clip(pi/mu): the correction squared
    assert not torch.allclose(twice, one) and not torch.allclose(twice, once)


@pytest.mark.parametrize("correction", ["token_truncate", "sequence_mask"])
def test_the_run_config_refuses_is_with_sampler_old_logprobs(correction):
    with pytest.raises(TrainConfigError, match="applies the correction twice"):
        TrainConfig.from_dict({"model": "m", "is_correction": correction, "old_logprobs": "sampler"})
    TrainConfig.from_dict({"model": "m", "is_correction": correction, "old_logprobs": "trainer"})
    TrainConfig.from_dict({"model": "m", "is_correction": "off", "old_logprobs": "sampler"})


def test_dose_grid_skips_and_marks_those_cells():
    import yaml

    from analysis.dose.stats import dose_rows, invalid_setting, thresholds
    from rpa.workflow.experiments import kind_cells
    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "experiments/config.yaml").read_text())
    points = [c.labels for c in kind_cells(config, "dose")]
    assert not [p for p in points if p["is_correction"] != "off" and p["old_logprobs"] == "sampler"]
    assert [p for p in points if p["is_correction"] == "off" and p["old_logprobs"] == "sampler"]
    committed = REPO / "results/reference/cpu"
    assert (committed / "dose").exists(), "committed dose grid missing (part of the contract)"
    runs = dose_rows(committed)
    bad = runs[[invalid_setting(c, o) for c, o in zip(runs.is_correction, runs.old_logprobs)]]
    assert len(bad) == 36 and bad["invalid"].all() and not runs.drop(bad.index)["invalid"].any()
    th = thresholds(runs, boot=0)
    assert set(th[th.kind == "invalid"].is_correction) == {"token_truncate", "sequence_mask"}
    assert (th[th.kind == "invalid"].old_logprobs == "sampler").all()
