/**
 * A live `treadle serve` for the tests: real models (tiny, random weights, built on
 * the spot by `treadle make-model`), a real server process on a free port, its default
 * tenant's key read from the file it names. `test/run.ts` starts one for the whole
 * suite and passes it down in TREADLE_TEST_* variables; a test file run alone starts
 * its own.
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { after, before } from "node:test";
import { fileURLToPath } from "node:url";
import { ServiceClient } from "../src/index.js";

/** The repository root (this file runs from clients/node/dist/test). */
export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
export const TREADLE = process.env["TREADLE_BIN"] ?? join(ROOT, ".venv", "bin", "treadle");
export const PYTHON = process.env["TREADLE_PYTHON"] ?? join(ROOT, ".venv", "bin", "python");

export interface TestServer {
  address: string;
  apiKey: string;
  dataDir: string;
  stop(): Promise<void>;
}

/** Base models the test server serves: the tiny one and the demo's (addition task). */
export const TINY = "tiny";
export const DEMO = "demo";

export interface ServerOptions {
  /** Base models to build and serve, name -> `make-model` preset. */
  models?: Record<string, string>;
  /** More `treadle serve` flags, e.g. --tls-cert/--tls-key; `tmp` is the server's directory. */
  extraArgs?: (tmp: string) => string[];
}

export async function startServer(options: ServerOptions = {}): Promise<TestServer> {
  const tmp = mkdtempSync(join(tmpdir(), "treadle-node-"));
  const models = options.models ?? { [TINY]: "tiny", [DEMO]: "demo" };
  for (const [name, preset] of Object.entries(models)) {
    const made = spawnSync(TREADLE, ["make-model", "--tiny", "--preset", preset, join(tmp, "models", name)], {
      encoding: "utf8",
    });
    if (made.status !== 0) throw new Error(`treadle make-model failed: ${made.stderr}`);
  }
  const dataDir = join(tmp, "data");
  const proc = spawn(
    TREADLE,
    [
      "serve",
      ...Object.keys(models).flatMap((name) => ["--model", `${name}=${join(tmp, "models", name)}`]),
      "--port",
      "0",
      "--http-port",
      "-1",
      "--data-dir",
      dataDir,
      // One engine thread: deterministic sums (the Python parity test compares bits)
      // and no OpenMP spin-waiting on a busy 2-core machine.
      "--threads",
      "1",
      "--sampler-slots",
      "512",
      "--sampler-max-len",
      "64",
      ...(options.extraArgs?.(tmp) ?? []),
    ],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  const { address, keyFile } = await waitForBanner(proc);
  const server: TestServer = {
    address,
    apiKey: readFileSync(keyFile, "utf8").trim(),
    dataDir,
    stop: async () => {
      if (proc.exitCode === null) {
        const exited = new Promise((r) => proc.once("exit", r));
        proc.kill("SIGTERM");
        await exited;
      }
      rmSync(tmp, { recursive: true, force: true });
    },
  };
  return server;
}

function waitForBanner(proc: ChildProcess): Promise<{ address: string; keyFile: string }> {
  return new Promise((resolvePromise, reject) => {
    let out = "";
    let err = "";
    const timer = setTimeout(() => reject(new Error(`treadle serve did not start in 120 s:\n${out}\n${err}`)), 120_000);
    proc.stderr!.on("data", (d: Buffer) => (err += d.toString()));
    proc.stdout!.on("data", (d: Buffer) => {
      out += d.toString();
      const serving = /serving .* on ([\w.:-]+):(\d+)/.exec(out);
      const key = /API key is in (\S+)/.exec(out);
      if (serving && key) {
        clearTimeout(timer);
        resolvePromise({ address: `127.0.0.1:${serving[2]}`, keyFile: key[1]! });
      }
    });
    proc.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`treadle serve exited with ${code}:\n${out}\n${err}`));
    });
  });
}

/** The suite's server (from test/run.ts), or one of this file's own. */
export async function testServer(): Promise<TestServer> {
  const address = process.env["TREADLE_TEST_ADDRESS"];
  const apiKey = process.env["TREADLE_TEST_API_KEY"];
  const dataDir = process.env["TREADLE_TEST_DATA_DIR"];
  if (address && apiKey && dataDir) return { address, apiKey, dataDir, stop: async () => {} };
  return startServer();
}

/** The file's server (`testServer`) and a client of it, made before its tests and
 * closed after them; read them inside the tests. */
export function sharedService(): { server: TestServer; service: ServiceClient } {
  const shared = {} as { server: TestServer; service: ServiceClient };
  before(async () => {
    shared.server = await testServer();
    const { address, apiKey } = shared.server;
    shared.service = new ServiceClient({ address, apiKey });
  });
  after(async () => {
    shared.service.close();
    await shared.server.stop();
  });
  return shared;
}

/** Run `treadle admin ...` against the server's database; its stdout. */
export function admin(server: TestServer, ...args: string[]): string {
  const proc = spawnSync(TREADLE, ["admin", "--data-dir", server.dataDir, ...args], { encoding: "utf8" });
  if (proc.status !== 0) throw new Error(`treadle admin ${args.join(" ")} failed: ${proc.stderr}`);
  return proc.stdout.trim();
}
