/**
 * The Node side of benchmarks/node_client.py: on a new LoRA model, `warmup` steps,
 * then `steps` steps of forwardBackward + optimStep (both sent at once, the step
 * awaited, as a user's loop does); prints each step's seconds as JSON.
 *
 *   node dist/bench/fb_optim.js SPEC.json   (address, apiKey, baseModel, rank, lr, steps, warmup, data)
 */
import { readFileSync } from "node:fs";
import { type Datum, ServiceClient } from "../src/index.js";

interface Spec {
  address: string;
  apiKey: string;
  baseModel: string;
  rank: number;
  lr: number;
  steps: number;
  warmup: number;
  data: Datum[];
}

const spec = JSON.parse(readFileSync(process.argv[2]!, "utf8")) as Spec;
const service = new ServiceClient({ address: spec.address, apiKey: spec.apiKey });
try {
  const trainer = await service.createLoraTrainingClient(spec.baseModel, { rank: spec.rank, seed: 0 });
  const step = () =>
    Promise.all([trainer.forwardBackward(spec.data, "cross_entropy"), trainer.optimStep({ learningRate: spec.lr })]);
  for (let i = 0; i < spec.warmup; i++) await step(); // connection, JIT, the model's first calls
  const times: number[] = [];
  for (let i = 0; i < spec.steps; i++) {
    const t0 = performance.now();
    await step();
    times.push((performance.now() - t0) / 1000);
  }
  await service.deleteModel(trainer.modelId);
  console.log(JSON.stringify({ times }));
} finally {
  service.close();
}
