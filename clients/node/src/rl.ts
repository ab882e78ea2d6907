/**
 * RL helpers, the Python SDK's `treadle.rl` essentials: group-relative advantages and
 * datums with the step's one denominator folded into the weights.
 *
 * The server sums (losses are sums, DESIGN.md): every normalisation is the client's,
 * as ONE denominator per optimizer step. Call `buildDatums` once per step on all the
 * rollouts that step trains on, then split the datums into minibatches as you like:
 * their summed gradients equal the gradient of one call with all of them.
 */
import { InvalidArgumentError } from "./errors.js";
import type { Datum, SampledSequence } from "./types.js";
import { finiteNumbers, integer, tokenIds } from "./validate.js";

/** One sampled completion and what the client learned about it. */
export interface Rollout {
  promptTokens: readonly number[];
  completionTokens: readonly number[];
  /** Behaviour logprobs, one per completion token. */
  completionLogprobs: readonly number[];
  reward: number;
}

export function rolloutFromSequence(promptTokens: readonly number[], seq: SampledSequence, reward: number): Rollout {
  return { promptTokens, completionTokens: seq.tokens, completionLogprobs: seq.logprobs, reward };
}

function groups(rewards: readonly number[], groupSize: number): number[][] {
  integer(groupSize, "groupSize", { min: 1 });
  finiteNumbers(rewards, "rewards");
  if (rewards.length % groupSize !== 0) {
    throw new InvalidArgumentError(`rewards: ${rewards.length} rewards is not a multiple of groupSize ${groupSize}`);
  }
  const out: number[][] = [];
  for (let i = 0; i < rewards.length; i += groupSize) out.push(rewards.slice(i, i + groupSize));
  return out;
}

const mean = (xs: readonly number[]): number => xs.reduce((a, b) => a + b, 0) / xs.length;

/**
 * One advantage per completion: its reward minus its group's mean reward (GRPO's
 * baseline; Dr.GRPO's: no division by the group's std). Rewards are laid out group
 * by group, as `sample` returns them.
 */
export function groupAdvantages(rewards: readonly number[], groupSize: number): number[] {
  return groups(rewards, groupSize).flatMap((g) => {
    const m = mean(g);
    return g.map((r) => r - m);
  });
}

/** Per group: true where the rewards differ (the others have zero advantage: no gradient). */
export function informativeGroups(rewards: readonly number[], groupSize: number, minStd = 1e-6): boolean[] {
  return groups(rewards, groupSize).map((g) => {
    const m = mean(g);
    return Math.sqrt(mean(g.map((r) => (r - m) ** 2))) > minStd;
  });
}

export type Aggregation = "token_mean" | "seq_mean_token_mean" | "sum";

/**
 * One datum per rollout, ready for `forwardBackward` with a policy loss: with
 * full = prompt + completion, `modelInput` = full[:-1] and per-position arrays aligned
 * to the next-token target full[1:]. Completion positions get the aggregation
 * factor as weight, the behaviour logprobs and the rollout's advantage; prompt
 * positions get 0 in all three.
 *
 * - token_mean: / total completion tokens of the step (DAPO, Dr.GRPO's token level)
 * - seq_mean_token_mean: sequence i / (C_i x non-empty sequences) (original GRPO)
 * - sum: no scaling
 */
export function buildDatums(
  rollouts: readonly Rollout[],
  advantages: readonly number[],
  aggregation: Aggregation = "token_mean",
): Datum[] {
  finiteNumbers(advantages, "advantages");
  if (advantages.length !== rollouts.length) {
    throw new InvalidArgumentError(`advantages: ${advantages.length} values for ${rollouts.length} rollouts`);
  }
  const lengths = rollouts.map((r) => r.completionTokens.length);
  const total = lengths.reduce((a, b) => a + b, 0);
  const nonEmpty = lengths.filter((n) => n > 0).length;
  const scale = (n: number): number => {
    switch (aggregation) {
      case "token_mean":
        return total ? 1 / total : 0;
      case "seq_mean_token_mean":
        return n ? 1 / (n * nonEmpty) : 0;
      case "sum":
        return 1;
      default:
        throw new InvalidArgumentError(`aggregation: unknown mode ${JSON.stringify(aggregation)}`);
    }
  };
  return rollouts.map((r, i) => {
    const prompt = tokenIds(r.promptTokens, `rollouts[${i}].promptTokens`, { nonEmpty: true });
    const completion = tokenIds(r.completionTokens, `rollouts[${i}].completionTokens`);
    const lps = finiteNumbers(r.completionLogprobs, `rollouts[${i}].completionLogprobs`);
    if (lps.length !== completion.length) {
      throw new InvalidArgumentError(
        `rollouts[${i}].completionLogprobs: ${lps.length} values for ${completion.length} completion tokens`,
      );
    }
    const full = [...prompt, ...completion];
    const n = full.length - 1;
    if (n === 0) throw new InvalidArgumentError(`rollouts[${i}]: a one-token prompt and no completion leave nothing to train on`);
    const first = prompt.length - 1; // the position whose target is the first completion token
    const weights = new Float32Array(n);
    const logprobs = new Float32Array(n);
    const adv = new Float32Array(n);
    const s = scale(completion.length);
    for (let t = first; t < n; t++) {
      weights[t] = s;
      logprobs[t] = lps[t - first]!;
      adv[t] = advantages[i]!;
    }
    return {
      modelInput: full.slice(0, -1),
      lossFnInputs: { target_tokens: full.slice(1), weights, logprobs, advantages: adv },
    };
  });
}
