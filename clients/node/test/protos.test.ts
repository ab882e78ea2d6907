/**
 * The protos as a product: `buf lint` passes with buf.yaml's rule set, and
 * `buf breaking` accepts the contract against the recorded baseline but catches a
 * deliberately removed field (a change that would break clients in any language),
 * while letting a scalar gain explicit presence (`optional`: same wire and JSON; the
 * SamplingParams knobs gained it after the baseline was recorded).
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { ROOT } from "./harness.js";

const BUF = join(ROOT, "clients", "node", "node_modules", ".bin", "buf");
const BASELINE = join(ROOT, ".ci", "proto-baseline.binpb");

function buf(cwd: string, ...args: string[]) {
  return spawnSync(BUF, args, { cwd, encoding: "utf8", timeout: 120_000 });
}

test("buf lint passes", () => {
  const run = buf(ROOT, "lint");
  assert.equal(run.status, 0, run.stdout + run.stderr);
});

test("buf breaking: the protos keep the baseline's contract; a removed field is caught", () => {
  const ok = buf(ROOT, "breaking", "--against", BASELINE);
  assert.equal(ok.status, 0, ok.stdout + ok.stderr);

  const tmp = mkdtempSync(join(tmpdir(), "treadle-buf-"));
  try {
    cpSync(join(ROOT, "buf.yaml"), join(tmp, "buf.yaml"));
    cpSync(join(ROOT, "protos"), join(tmp, "protos"), { recursive: true });
    const file = join(tmp, "protos", "treadle", "v1", "sampling.proto");
    const text = readFileSync(file, "utf8");
    const removed = text.replace(/^\s*optional int32 top_k = 4;.*\n/m, "");
    assert.notEqual(removed, text, "the field to remove is in sampling.proto");
    // Explicit presence for a scalar keeps the wire and JSON: accepted (buf.yaml). The
    // baseline's SamplingParams knobs are plain and the protos' gained `optional` since,
    // so the check above is that case.
    assert.match(text, /^\s*optional double temperature = 2;/m);
    writeFileSync(file, removed);
    const bad = buf(tmp, "breaking", "--against", BASELINE);
    assert.notEqual(bad.status, 0, "buf breaking accepted a removed field");
    assert.match(bad.stdout + bad.stderr, /"top_k" on message "SamplingParams" was deleted/);
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});
