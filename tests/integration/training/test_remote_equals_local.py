"""Remote equals local (DESIGN invariant 4; issue 3, "Training numerics").

20 optimizer steps of SFT (``cross_entropy``) and 20 of PPO (2 epochs x 4
minibatches per rollout batch, the optimizer stepping INSIDE the minibatch loop
as in the seed's ``minibatch_update_loop``) run through SDK -> gRPC -> engine,
and the same steps run here, in-process, by a plain-torch reference written from
the formulas alone: docs/losses.md for the losses, the AdamW docstring of
``treadle.workers.trainer.optimizer`` for the update.

The reference shares no code and no initialisation logic with the engine. It
starts from the files ``save_state`` exported (``weights.safetensors`` with PEFT
or HF names, ``manifest.json``), read with safetensors next to the base model's
``model.safetensors``; it has its own Llama forward (RMSNorm, RoPE, GQA, SwiGLU),
its own LoRA (``W x + alpha/r * B A x``) and its own AdamW; torch's autograd
gives its gradients. The only things the two sides share are the data: the SFT
batches, and for PPO the rollouts the engine's sampler drew (tokens and
behaviour logprobs), which the reference takes as given.

In float64 every step's loss (and the optimizer's diagnostics) agrees to 1e-10
relative; in float32 every step's loss to 1e-5 and the final weights to
``||dW|| / ||W|| <= 1e-5``. Both for full fine-tuning and for LoRA. (float32 runs
with Adam's eps at 1e-5 rather than 1e-12: see ``ADAM_EPS`` for why.)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import treadle
from treadle import rl
from treadle.server.embedded import EmbeddedServer

STEPS = 20
LORA_RANK = 4
LEARNING_RATE = {"full": 1e-3, "lora": 5e-3}
#: Adam's eps per dtype. float64 runs with the SDK's default, 1e-12. float32 runs with
#: LLaMA's 1e-5, because float32 AdamW with a tiny eps is ill-conditioned in any
#: implementation: an element's update is lr*g/(sqrt(v) + eps), so the absolute
#: rounding noise of a float32 gradient (~1e-7 of its summands) becomes an O(lr)
#: update wherever sqrt(v) is tiny. Seen here: an element whose first gradient was
#: 2e-11 (largest 1e-4) moved by +-lr on a coin flip with eps = 1e-12, and one of
#: 6e-9 with eps = 1e-8; the trajectories then drift apart by 5e-5 to 2e-4 of ||W||.
#: With eps = 1e-5 the noise is bounded by lr * noise / eps, and the runs agree to
#: ~5e-7 (the float64 runs check the formula at eps = 1e-12 to 1e-10).
ADAM_EPS = {"float64": 1e-12, "float32": 1e-5}
PPO_CONFIG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}  # DAPO's clip-higher
PPO_TEMPERATURE = 0.9  # sampled at 0.9; the loss takes the same temperature
PROMPTS = ("1+2=", "34+5=", "7*8=", "9-4=")
GROUP = 4
MINIBATCHES = 4
EPOCHS = 2
SFT_CORPUS = ("12+3=15", "4+4=8", "20-7=13", "6*7=42", "9+10=19", "33-3=30", "5*5=25", "8+1=9")

TOLERANCE = {  # dtype -> (loss relative, weights relative)
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-5),
}


# ---------------------------------------------------------------------------- reference


@dataclass
class Reference:
    """A Llama-family causal LM with optional LoRA, and AdamW, in plain torch.

    ``frozen`` holds the base model's HF-named tensors; ``trainable`` the tensors
    ``save_state`` exported (HF names for a full fine-tune, which then override
    ``frozen``; PEFT names for LoRA).
    """

    config: dict
    frozen: dict[str, torch.Tensor]
    trainable: dict[str, torch.Tensor]
    lora_scale: float | None
    dtype: torch.dtype
    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_files(cls, base_dir: Path, state_dir: Path, dtype: torch.dtype) -> Reference:
        config = json.loads((base_dir / "config.json").read_text())
        manifest = json.loads((state_dir / "manifest.json").read_text())
        frozen = {k: v.to(dtype) for k, v in load_file(str(base_dir / "model.safetensors")).items()}
        trainable = {
            k: v.to(dtype).requires_grad_(True)
            for k, v in load_file(str(state_dir / "weights.safetensors")).items()
        }
        rank = int(manifest["lora_rank"])
        scale = float(manifest["lora_alpha"]) / rank if rank else None
        ref = cls(config, frozen, trainable, scale, dtype)
        ref.exp_avg = {k: torch.zeros_like(v) for k, v in trainable.items()}
        ref.exp_avg_sq = {k: torch.zeros_like(v) for k, v in trainable.items()}
        return ref

    # ---- forward ------------------------------------------------------------------

    def weight(self, name: str) -> torch.Tensor:
        return self.trainable[name] if name in self.trainable else self.frozen[name]

    def linear(self, x: torch.Tensor, layer: int, module: str, proj: str) -> torch.Tensor:
        y = x @ self.weight(f"model.layers.{layer}.{module}.{proj}.weight").T
        return self.lora(x, y, f"base_model.model.model.layers.{layer}.{module}.{proj}")

    def lora(self, x: torch.Tensor, y: torch.Tensor, prefix: str) -> torch.Tensor:
        """``y + scale * B A x`` where the adapter targets ``prefix``'s module."""
        if self.lora_scale is not None and f"{prefix}.lora_A.weight" in self.trainable:
            a = self.trainable[f"{prefix}.lora_A.weight"]  # [r, in]
            b = self.trainable[f"{prefix}.lora_B.weight"]  # [out, r]
            y = y + self.lora_scale * ((x @ a.T) @ b.T)
        return y

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        eps = self.config["rms_norm_eps"]
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(self, x_H_T_D: torch.Tensor) -> torch.Tensor:
        T, D = x_H_T_D.shape[1], x_H_T_D.shape[2]
        theta = self.config.get("rope_theta") or self.config["rope_parameters"]["rope_theta"]
        inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        angles_T_D2 = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles_T_D = torch.cat([angles_T_D2, angles_T_D2], dim=-1)
        cos, sin = angles_T_D.cos().to(self.dtype), angles_T_D.sin().to(self.dtype)
        x1, x2 = x_H_T_D[..., : D // 2], x_H_T_D[..., D // 2 :]
        return x_H_T_D * cos + torch.cat([-x2, x1], dim=-1) * sin

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        c = self.config
        n_q, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or c["hidden_size"] // n_q
        T = len(tokens)
        x = self.weight("model.embed_tokens.weight")[torch.tensor(tokens)]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for n in range(c["num_hidden_layers"]):
            h = self.rms_norm(x, self.weight(f"model.layers.{n}.input_layernorm.weight"))
            q = self.linear(h, n, "self_attn", "q_proj").view(T, n_q, d).transpose(0, 1)
            k = self.linear(h, n, "self_attn", "k_proj").view(T, n_kv, d).transpose(0, 1)
            v = self.linear(h, n, "self_attn", "v_proj").view(T, n_kv, d).transpose(0, 1)
            q, k = self.rope(q), self.rope(k)
            k = k.repeat_interleave(n_q // n_kv, dim=0)  # query head i reads kv head i // group
            v = v.repeat_interleave(n_q // n_kv, dim=0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ v  # [Hq, T, D]
            attn = attn.transpose(0, 1).reshape(T, n_q * d)
            x = x + self.linear(attn, n, "self_attn", "o_proj")
            h = self.rms_norm(x, self.weight(f"model.layers.{n}.post_attention_layernorm.weight"))
            gate = self.linear(h, n, "mlp", "gate_proj")
            up = self.linear(h, n, "mlp", "up_proj")
            x = x + self.linear(torch.nn.functional.silu(gate) * up, n, "mlp", "down_proj")
        x = self.rms_norm(x, self.weight("model.norm.weight"))
        head = "model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight"
        return self.lora(x, x @ self.weight(head).T, "base_model.model.lm_head")  # train_unembed

    def logprobs(self, datum: treadle.Datum, temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / T) at each target (docs/losses.md: the policy's logprob)."""
        logits = self.logits(datum.model_input.to_ints()) / temperature
        targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"])
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    # ---- losses (docs/losses.md: loss = sum_t w_t * l_t, no hidden denominator) --------

    def _input(self, datum: treadle.Datum, key: str) -> torch.Tensor:
        return torch.as_tensor(np.asarray(datum.loss_fn_inputs[key], dtype=np.float64)).to(
            self.dtype
        )

    def cross_entropy(self, data: Sequence[treadle.Datum]) -> torch.Tensor:
        return sum(-(self._input(d, "weights") * self.logprobs(d)).sum() for d in data)

    def ppo(
        self, data: Sequence[treadle.Datum], low: float, high: float, temperature: float
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=self.dtype)
        for d in data:
            w, adv = self._input(d, "weights"), self._input(d, "advantages")
            behaviour = self._input(d, "logprobs")
            logp = self.logprobs(d, temperature)
            carries = w != 0  # prompt targets carry no loss (their behaviour logprob is 0)
            ratio = torch.exp(torch.where(carries, logp - behaviour, torch.zeros_like(logp)))
            per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
            total = total + (w * per_token).sum()
        return total

    # ---- AdamW (the docstring of treadle.workers.trainer.optimizer) ------------------------------

    @torch.no_grad()
    def adamw(self, hp: treadle.AdamParams) -> dict[str, float]:
        grads = {
            n: p.grad if p.grad is not None else torch.zeros_like(p)
            for n, p in self.trainable.items()
        }
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        scale = min(1.0, hp.grad_clip_norm / (norm + 1e-6)) if hp.grad_clip_norm > 0 else 1.0
        self.step += 1
        t = self.step
        update_sq = 0.0
        for name, p in self.trainable.items():
            g = grads[name] * scale
            m = self.exp_avg[name] = hp.beta1 * self.exp_avg[name] + (1 - hp.beta1) * g
            v = self.exp_avg_sq[name] = hp.beta2 * self.exp_avg_sq[name] + (1 - hp.beta2) * g * g
            m_hat, v_hat = m / (1 - hp.beta1**t), v / (1 - hp.beta2**t)
            update = -hp.learning_rate * m_hat / (torch.sqrt(v_hat) + hp.eps)
            update = update - hp.learning_rate * hp.weight_decay * p
            p += update
            update_sq += float((update * update).sum())
            p.grad = None
        return {
            "grad_norm:value": norm,
            "update_norm:value": math.sqrt(update_sq),
            "learning_rate:value": hp.learning_rate,
            "step:value": float(t),
        }


# ---------------------------------------------------------------------------- harness


@dataclass
class Run:
    """One case's per-step numbers, remote and local."""

    remote_loss: list[float] = field(default_factory=list)
    local_loss: list[float] = field(default_factory=list)
    remote_optim: list[dict[str, float]] = field(default_factory=list)
    local_optim: list[dict[str, float]] = field(default_factory=list)
    clip_frac: list[float] = field(default_factory=list)  # PPO: largest of the step's calls

    def max_loss_rel(self) -> float:
        return max(
            abs(r - loc) / max(abs(loc), 1e-30)
            for r, loc in zip(self.remote_loss, self.local_loss, strict=True)
        )

    def max_optim_rel(self) -> float:
        worst = 0.0
        for r, loc in zip(self.remote_optim, self.local_optim, strict=True):
            for key, value in loc.items():
                worst = max(worst, abs(r[key] - value) / max(abs(value), 1e-30))
        return worst


def _state_dir(server: EmbeddedServer, model_id: str, name: str) -> Path:
    found = list(Path(server.config.checkpoint_root).glob(f"*/{model_id}/{name}"))
    assert len(found) == 1, found
    return found[0]


def _adam(mode: str, dtype: str) -> treadle.AdamParams:
    """Weight decay and clipping on, so every term of the AdamW formula is exercised."""
    return treadle.AdamParams(
        learning_rate=LEARNING_RATE[mode],
        eps=ADAM_EPS[dtype],
        weight_decay=0.01,
        grad_clip_norm=0.5,  # clips some steps and not others (grad norms 0.05 to 6)
    )


def _create(
    service: treadle.ServiceClient, mode: str, dtype: str, seed: int
) -> treadle.TrainingClient:
    if mode == "lora":
        return service.create_lora_training_client("tiny", rank=LORA_RANK, seed=seed, dtype=dtype)
    return service.create_training_client("tiny", seed=seed, dtype=dtype)


def _weights_rel_diff(saved: dict[str, torch.Tensor], ref: Reference) -> float:
    assert set(saved) == set(ref.trainable)
    diff_sq = sum(
        float(((saved[n].double() - p.detach().double()) ** 2).sum())
        for n, p in ref.trainable.items()
    )
    norm_sq = sum(float((p.detach().double() ** 2).sum()) for p in ref.trainable.values())
    return math.sqrt(diff_sq / norm_sq)


def _step(
    tc: treadle.TrainingClient,
    ref: Reference,
    calls: Sequence[Sequence[treadle.Datum]],
    loss_fn: str,
    hp: treadle.AdamParams,
    run: Run,
) -> None:
    """One optimizer step: its datums in several forward_backward calls (the gradients
    accumulate), then optim_step; the same, locally."""
    config = PPO_CONFIG if loss_fn == "ppo" else None
    temperature = PPO_TEMPERATURE if loss_fn == "ppo" else 1.0
    futures = [tc.forward_backward(c, loss_fn, config, temperature=temperature) for c in calls]
    optim = tc.optim_step(hp)
    metrics = [f.result().metrics for f in futures]
    run.remote_loss.append(sum(m["loss:sum"] for m in metrics))
    run.clip_frac.append(max(m.get("clip_frac:mean", 0.0) for m in metrics))
    run.remote_optim.append(optim.result().metrics)

    local = 0.0
    for c in calls:
        if loss_fn == "ppo":
            loss = ref.ppo(
                c, PPO_CONFIG["clip_low_threshold"], PPO_CONFIG["clip_high_threshold"], temperature
            )
        else:
            loss = ref.cross_entropy(c)
        loss.backward()
        local += float(loss.detach())
    run.local_loss.append(local)
    run.local_optim.append(ref.adamw(hp))


def _sft_batches(tokenizer: treadle.Tokenizer, np_dtype: type) -> Iterator[list[treadle.Datum]]:
    """4 examples a step, loss on the answer only, token mean over the step's answer
    tokens (the one denominator)."""
    rng = np.random.default_rng(0)
    while True:
        texts = [SFT_CORPUS[i] for i in rng.choice(len(SFT_CORPUS), size=4, replace=False)]
        seqs = [tokenizer.encode(t) for t in texts]
        prompt_lens = [t.index("=") + 1 for t in texts]
        n_answer = sum(len(s) - p for s, p in zip(seqs, prompt_lens, strict=True))
        batch = []
        for seq, p in zip(seqs, prompt_lens, strict=True):
            weights = np.zeros(len(seq) - 1, dtype=np_dtype)
            weights[p - 1 :] = 1.0 / n_answer
            batch.append(
                treadle.Datum(
                    model_input=treadle.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
                )
            )
        yield batch


def _reward(tokenizer: treadle.Tokenizer, tokens: Sequence[int]) -> float:
    """In (0, 1]: more digits is better. Strictly positive on purpose, see ``run_ppo``."""
    text = tokenizer.decode(tokens)
    return (1 + sum(ch.isdigit() for ch in text)) / (1 + len(tokens))


def run_sft(
    service: treadle.ServiceClient, server: EmbeddedServer, base_dir: Path, mode: str, dtype: str
) -> tuple[Run, float]:
    tc = _create(service, mode, dtype, seed=11)
    tokenizer = tc.get_tokenizer()
    tc.save_state("init").result()
    ref = Reference.from_files(base_dir, _state_dir(server, tc.model_id, "init"), _DTYPES[dtype])
    run = Run()
    batches = _sft_batches(tokenizer, np.float64 if dtype == "float64" else np.float32)
    for _ in range(STEPS):
        batch = next(batches)
        _step(tc, ref, [batch[:2], batch[2:]], "cross_entropy", _adam(mode, dtype), run)
    return run, _final_diff(tc, server, ref)


def run_ppo(
    service: treadle.ServiceClient, server: EmbeddedServer, base_dir: Path, mode: str, dtype: str
) -> tuple[Run, float]:
    """Rollout batches of len(PROMPTS) x GROUP completions; per batch EPOCHS passes
    over MINIBATCHES shuffled minibatches, one optimizer step per minibatch, until
    STEPS optimizer steps (the third batch's second epoch is cut short)."""
    tc = _create(service, mode, dtype, seed=12)
    tokenizer = tc.get_tokenizer()
    tc.save_state("init").result()
    ref = Reference.from_files(base_dir, _state_dir(server, tc.model_id, "init"), _DTYPES[dtype])
    run = Run()
    rng = np.random.default_rng(1)
    params = treadle.SamplingParams(max_tokens=6, temperature=PPO_TEMPERATURE, seed=0)
    steps = 0
    while steps < STEPS:
        sampler = tc.sync_weights()
        futures = [(p, sampler.sample(tokenizer.encode(p), GROUP, params)) for p in PROMPTS]
        rollouts = []
        for prompt, fut in futures:
            for seq in fut.result().sequences:
                rollouts.append(
                    rl.Rollout.from_sequence(
                        tokenizer.encode(prompt), seq, reward=_reward(tokenizer, seq.tokens)
                    )
                )
        # REINFORCE's advantage, the reward itself (no baseline). A group-mean baseline
        # makes a minibatch's loss a sum of terms that cancel, down to ~0 when the ratio
        # is ~1 (a step's loss was 7e-10 from terms of 1e-2): "agrees to 1e-10
        # relative" would then compare rounding noise. With A > 0 every term has the
        # same sign, so the loss is as well conditioned as its terms.
        advantages = np.array([r.reward for r in rollouts])
        for _ in range(EPOCHS):
            order = rng.permutation(len(rollouts))
            for mb in np.array_split(order, MINIBATCHES):
                if steps == STEPS:
                    break
                # one denominator per optimizer step: this minibatch's completion tokens
                datums = rl.build_datums([rollouts[i] for i in mb], advantages[mb])
                half = len(datums) // 2
                _step(tc, ref, [datums[:half], datums[half:]], "ppo", _adam(mode, dtype), run)
                steps += 1
    return run, _final_diff(tc, server, ref)


def _final_diff(tc: treadle.TrainingClient, server: EmbeddedServer, ref: Reference) -> float:
    tc.save_state("final").result()
    saved = load_file(str(_state_dir(server, tc.model_id, "final") / "weights.safetensors"))
    return _weights_rel_diff(saved, ref)


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("algo", ["sft", "ppo"])
def test_remote_equals_local(
    service: treadle.ServiceClient,
    server: EmbeddedServer,
    tiny_model_dir: Path,
    algo: str,
    mode: str,
    dtype: str,
) -> None:
    t0 = time.perf_counter()
    runner = run_sft if algo == "sft" else run_ppo
    run, weights_rel = runner(service, server, tiny_model_dir, mode, dtype)
    loss_tol, weights_tol = TOLERANCE[dtype]
    loss_rel = run.max_loss_rel()
    print(
        f"\n{algo}/{mode}/{dtype}: max loss rel {loss_rel:.2e}, weights rel {weights_rel:.2e}, "
        f"optim metrics rel {run.max_optim_rel():.2e}, losses {run.local_loss[0]:.4f} -> "
        f"{run.local_loss[-1]:.4f}, steps with clipping {sum(c > 0 for c in run.clip_frac)}, "
        f"{time.perf_counter() - t0:.1f}s"
    )
    assert len(run.remote_loss) == STEPS
    # the steps trained: the loss moved (a test where nothing changes proves nothing)
    assert run.local_loss[0] != pytest.approx(run.local_loss[-1], rel=1e-3)
    assert loss_rel <= loss_tol, (run.remote_loss, run.local_loss)
    assert weights_rel <= weights_tol
    # optim_step's diagnostics: pre-clip grad norm, update norm, lr, step number
    steps = [m["step:value"] for m in run.remote_optim]
    assert steps == [float(i) for i in range(1, STEPS + 1)]
    assert all(m["learning_rate:value"] == LEARNING_RATE[mode] for m in run.remote_optim)
    assert run.max_optim_rel() <= (1e-10 if dtype == "float64" else 1e-4)
    if algo == "ppo":  # the clip was exercised, and the reference clipped the same tokens
        assert any(c > 0 for c in run.clip_frac)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_float64_end_to_end(
    service: treadle.ServiceClient, server: EmbeddedServer, tiny_model_dir: Path, mode: str
) -> None:
    """A float64 model is float64 throughout: the saved weights, the inputs the loss
    reads, and the logprobs sent back (which match the reference to 1e-12)."""
    tc = _create(service, mode, "float64", seed=13)
    assert tc.get_info().dtype == "float64"
    batch = next(_sft_batches(tc.get_tokenizer(), np.float64))
    tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(_adam(mode, "float64"))
    tc.save_state("f64").result()
    state = _state_dir(server, tc.model_id, "f64")
    assert json.loads((state / "manifest.json").read_text())["dtype"] == "float64"
    saved = load_file(str(state / "weights.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float64}
    ref = Reference.from_files(tiny_model_dir, state, torch.float64)

    for out in (
        tc.forward_logprobs(batch, temperature=0.8).result(),
        tc.forward_backward(batch, "cross_entropy", temperature=0.8).result(),
    ):
        for datum, output in zip(batch, out.loss_fn_outputs, strict=True):
            assert output.logprobs.dtype == np.float64
            expected = ref.logprobs(datum, 0.8).detach().numpy()
            np.testing.assert_allclose(output.logprobs, expected, rtol=0, atol=1e-12)
