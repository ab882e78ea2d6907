/** The README's Node example ("From other languages") runs as written against a
 * live server (its import pointed at this checkout's build). */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { after, before, test } from "node:test";
import ts from "typescript";
import { ROOT, type TestServer, testServer } from "./harness.js";

let server: TestServer;
before(async () => {
  server = await testServer();
});
after(async () => {
  await server.stop();
});

test("the README's Node example runs", () => {
  const readme = readFileSync(join(ROOT, "README.md"), "utf8");
  const section = readme.slice(readme.indexOf("**Node.js / TypeScript**"));
  const code = /```ts\n([\s\S]*?)```/.exec(section)?.[1];
  assert.ok(code, "no ts block in the README's Node section");
  assert.ok(code.split("\n").filter(Boolean).length <= 12, "the example stays about ten lines");
  const dist = pathToFileURL(join(ROOT, "clients", "node", "dist", "src", "index.js")).href;
  const js = ts.transpileModule(code.replace('"@treadle/client"', JSON.stringify(dist)), {
    compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 },
  }).outputText;
  const dir = mkdtempSync(join(tmpdir(), "treadle-readme-"));
  try {
    const file = join(dir, "example.mjs");
    writeFileSync(file, js);
    const run = spawnSync(process.execPath, [file], {
      encoding: "utf8",
      timeout: 120_000,
      env: { ...process.env, TREADLE_ADDRESS: server.address, TREADLE_API_KEY: server.apiKey },
    });
    assert.equal(run.status, 0, run.stderr);
    // Four streamed samples, then loss and step. A sample is random text (no seed) and
    // may decode to a newline, so the lines are not counted: each index starts one.
    const lines = run.stdout.trim().split("\n");
    assert.match(lines.at(-1)!, /^\d+(\.\d+)? 1$/, run.stdout);
    const indices = new Set(lines.slice(0, -1).map((l) => /^([0-3]) /.exec(l)?.[1]).filter((i) => i !== undefined));
    assert.deepEqual([...indices].sort(), ["0", "1", "2", "3"], run.stdout);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
