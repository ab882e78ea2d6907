/**
 * GRPO from Node: teach a small random-weight model single-digit addition
 * ("7+5=" -> "12"), the task of `treadle demo`, through @treadle/client only.
 *
 *   treadle make-model --tiny --preset demo ./models/demo
 *   treadle serve --model demo=./models/demo --port 50051 --threads 1 --sampler-slots 512
 *   export TREADLE_API_KEY=$(cat treadle-data/default-tenant.key)   # the path serve prints
 *   npm run example -- --rl-steps 30
 *
 * 1. A supervised warm-up (cross_entropy on the answer tokens) that stops once the
 *    model is right some of the time: GRPO learns only from groups whose
 *    completions disagree.
 * 2. GRPO, each step the five phases: (1) rollout: G completions per prompt;
 *    (2) reward: exact match, scored here; (3) experience prep: the trainer's
 *    logprobs as the ratio's denominator, group-relative advantages; (4) learn: the
 *    clipped surrogate (DAPO's 0.8/1.28 clip) in minibatches, token-mean normalised,
 *    forwardBackward + optimStep each; (5) weight sync: the next step's sampler.
 *
 * A full fine-tune, as in the demo: on random weights a LoRA adapter cannot move the
 * frozen output head's near-uniform predictions far enough.
 */
import { pathToFileURL } from "node:url";
import { rl, type Datum, type SampledSequence, type SamplingClient, ServiceClient, type Tokenizer, type TrainingClient } from "../src/index.js";

export interface Plan {
  baseModel: string;
  seed: number;
  sftMaxSteps: number;
  sftBatch: number;
  sftLr: number;
  sftTarget: number; // stop the warm-up once the sampled accuracy reaches this
  sftProbeEvery: number;
  rlSteps: number;
  promptsPerStep: number;
  groupSize: number;
  minibatches: number; // optimizer steps per batch of rollouts
  rlLr: number;
  temperature: number;
  maxTokens: number; // two digits + EOS, and one spare
}

export const PLAN: Plan = {
  baseModel: "demo",
  seed: 0,
  sftMaxSteps: 300,
  sftBatch: 64,
  sftLr: 3e-3,
  sftTarget: 0.35,
  sftProbeEvery: 10,
  rlSteps: 30,
  promptsPerStep: 64,
  groupSize: 8,
  minibatches: 4,
  rlLr: 3e-4,
  temperature: 1.0,
  maxTokens: 4,
};

const PPO_CLIP = { clip_low_threshold: 0.8, clip_high_threshold: 1.28 };

// ---- the task: single-digit addition, scored by exact match ------------------------

interface Problem {
  question: string;
  answer: string;
}

const PROBLEMS: Problem[] = Array.from({ length: 100 }, (_, i) => {
  const [a, b] = [Math.floor(i / 10), i % 10];
  return { question: `${a}+${b}=`, answer: String(a + b) };
});

function promptTokens(tok: Tokenizer, p: Problem): number[] {
  return [tok.bosTokenId!, ...tok.encode(p.question)];
}

/** 1 for the answer followed by EOS, else 0. */
function exactMatch(tok: Tokenizer, seq: SampledSequence, p: Problem): number {
  return seq.stopReason === "stop" && tok.decode(seq.tokens) === p.answer ? 1 : 0;
}

/** Teach the answer only (prompt positions weigh 0), `scale` per answer token. */
function sftDatum(tok: Tokenizer, p: Problem, scale: number): Datum {
  const prompt = promptTokens(tok, p);
  const full = [...prompt, ...tok.encode(p.answer), tok.eosTokenId!];
  return {
    modelInput: full.slice(0, -1),
    lossFnInputs: {
      target_tokens: full.slice(1),
      weights: full.slice(1).map((_, t) => (t >= prompt.length - 1 ? scale : 0)),
    },
  };
}

/** A small seeded generator (mulberry32), so a run repeats. */
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = Math.imul(s ^ (s >>> 15), 1 | s);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function shuffled<T>(xs: readonly T[], random: () => number): T[] {
  const out = [...xs];
  for (let i = out.length - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [out[i], out[j]] = [out[j]!, out[i]!];
  }
  return out;
}

const mean = (xs: readonly number[]): number => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : 0);

/** Mean exact match over every problem, the same seeds every time. */
async function evaluate(sampler: SamplingClient, tok: Tokenizer, plan: Plan, samples: number): Promise<number> {
  const results = await Promise.all(
    PROBLEMS.map((p, i) =>
      sampler.sample(promptTokens(tok, p), samples, { maxTokens: plan.maxTokens, temperature: plan.temperature, seed: i }),
    ),
  );
  return mean(results.flatMap((r, i) => r.sequences.map((s) => exactMatch(tok, s, PROBLEMS[i]!))));
}

// ---- phase 0: supervised warm-up --------------------------------------------------------

async function warmUp(trainer: TrainingClient, tok: Tokenizer, plan: Plan, random: () => number) {
  let accuracy = 0;
  let pending: Promise<unknown>[] = [];
  for (let step = 1; step <= plan.sftMaxSteps; step++) {
    const batch = Array.from({ length: plan.sftBatch }, () => PROBLEMS[Math.floor(random() * PROBLEMS.length)]!);
    const nTokens = batch.reduce((n, p) => n + p.answer.length + 1, 0); // token mean: one denominator
    // Not awaited: the client numbers the calls, the server applies them in order.
    pending.push(trainer.forwardBackward(batch.map((p) => sftDatum(tok, p, 1 / nTokens))));
    pending.push(trainer.optimStep({ learningRate: plan.sftLr }));
    if (step % plan.sftProbeEvery === 0) {
      await Promise.all(pending); // throws the first failure, if any
      pending = [];
      accuracy = await evaluate(await trainer.syncWeights(), tok, plan, 1);
      if (accuracy >= plan.sftTarget) return { steps: step, accuracy };
    }
  }
  await Promise.all(pending);
  return { steps: plan.sftMaxSteps, accuracy };
}

// ---- one GRPO step: the five phases -----------------------------------------------------

export interface StepMetrics {
  reward: number;
  loss: number;
  clipFrac: number;
  groups: number;
  tokens: number;
}

async function rlStep(trainer: TrainingClient, sampler: SamplingClient, tok: Tokenizer, plan: Plan, random: () => number) {
  const G = plan.groupSize;

  // (1) rollout: every prompt's G completions, all requests in flight at once
  const problems = shuffled(PROBLEMS, random).slice(0, plan.promptsPerStep);
  const prompts = problems.map((p) => promptTokens(tok, p));
  const responses = await Promise.all(
    prompts.map((prompt) =>
      sampler.sample(prompt, G, {
        maxTokens: plan.maxTokens,
        temperature: plan.temperature,
        seed: Math.floor(random() * 2 ** 31),
      }),
    ),
  );

  // (2) reward, on the client
  let rollouts = responses.flatMap((r, i) =>
    r.sequences.map((seq) => rl.rolloutFromSequence(prompts[i]!, seq, exactMatch(tok, seq, problems[i]!))),
  );
  const rewards = rollouts.map((r) => r.reward);
  const metrics: StepMetrics = {
    reward: mean(rewards),
    loss: 0,
    clipFrac: 0,
    groups: 0,
    tokens: rollouts.reduce((n, r) => n + r.completionTokens.length, 0),
  };

  // (3) experience prep: keep groups that disagree (the others have zero advantage),
  // recompute the behaviour logprobs on the trainer, centre rewards per group.
  const informative = rl.informativeGroups(rewards, G);
  const keep = rollouts.map((_, i) => informative[Math.floor(i / G)]!);
  const advantages = rl.groupAdvantages(rewards, G).filter((_, i) => keep[i]);
  rollouts = rollouts.filter((_, i) => keep[i]);
  metrics.groups = rollouts.length / G;
  if (rollouts.length > 0) {
    const recomputed = await trainer.forwardLogprobs(rl.buildDatums(rollouts, advantages), {
      temperature: plan.temperature,
    });
    rollouts = rollouts.map((r, i) => ({
      ...r,
      completionLogprobs: Array.from(recomputed.lossFnOutputs[i]!.logprobs.slice(r.promptTokens.length - 1)),
    }));

    // (4) learn: shuffled minibatches, one optimizer step each, each normalised by its
    // own token count (token mean per optimizer step); all calls in flight together.
    const order = shuffled([...rollouts.keys()], random);
    const n = Math.min(plan.minibatches, order.length);
    const calls = [];
    for (let m = 0; m < n; m++) {
      const mb = order.slice(Math.floor((m * order.length) / n), Math.floor(((m + 1) * order.length) / n));
      const datums = rl.buildDatums(mb.map((i) => rollouts[i]!), mb.map((i) => advantages[i]!), "token_mean");
      calls.push(trainer.forwardBackward(datums, "ppo", { lossFnConfig: PPO_CLIP, temperature: plan.temperature }));
      calls.push(trainer.optimStep({ learningRate: plan.rlLr }));
    }
    const outs = await Promise.all(calls);
    const fb = outs.filter((_, i) => i % 2 === 0) as Awaited<ReturnType<TrainingClient["forwardBackward"]>>[];
    metrics.loss = fb.reduce((s, o) => s + o.metrics["loss:sum"]!, 0);
    metrics.clipFrac = mean(fb.map((o) => o.metrics["clip_frac:mean"] ?? 0));
  }

  // (5) weight sync: the next step samples from the weights just trained
  return { sampler: await trainer.syncWeights(), metrics };
}

// ---- the run ----------------------------------------------------------------------------

export async function runGrpo(service: ServiceClient, plan: Plan = PLAN, log: (line: string) => void = console.log) {
  const random = rng(plan.seed);
  const tok = await service.getTokenizer(plan.baseModel);
  const trainer = await service.createTrainingClient(plan.baseModel, { seed: plan.seed }); // full fine-tune

  const warm = await warmUp(trainer, tok, plan, random);
  log(`warm-up: ${warm.steps} supervised steps; sampled exact match ${warm.accuracy.toFixed(3)}`);

  log(" step  reward      loss    clip  groups  tokens      s");
  let sampler = await trainer.syncWeights();
  const history: StepMetrics[] = [];
  for (let step = 1; step <= plan.rlSteps; step++) {
    const t0 = performance.now();
    const out = await rlStep(trainer, sampler, tok, plan, random);
    sampler = out.sampler;
    const m = out.metrics;
    history.push(m);
    const s = ((performance.now() - t0) / 1000).toFixed(2);
    log(
      `${String(step).padStart(5)} ${m.reward.toFixed(3).padStart(7)} ${m.loss.toFixed(4).padStart(9)} ` +
        `${m.clipFrac.toFixed(3).padStart(7)} ${String(m.groups).padStart(7)} ${String(m.tokens).padStart(7)} ${s.padStart(6)}`,
    );
  }
  await service.deleteModel(trainer.modelId);
  return { sftSteps: warm.steps, sftAccuracy: warm.accuracy, history };
}

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const flag = (name: string): string | undefined => {
    const i = args.indexOf(name);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const plan: Plan = {
    ...PLAN,
    rlSteps: Number(flag("--rl-steps") ?? PLAN.rlSteps),
    baseModel: flag("--base-model") ?? PLAN.baseModel,
    seed: Number(flag("--seed") ?? PLAN.seed),
  };
  const service = new ServiceClient(); // TREADLE_ADDRESS (default localhost:50051), TREADLE_API_KEY
  try {
    const { history } = await runGrpo(service, plan);
    const k = Math.max(1, Math.floor(history.length / 4));
    const first = mean(history.slice(0, k).map((m) => m.reward));
    const last = mean(history.slice(-k).map((m) => m.reward));
    console.log(`rollout reward ${first.toFixed(3)} in the first ${k} steps -> ${last.toFixed(3)} in the last ${k}`);
  } finally {
    service.close();
  }
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  await main();
}
