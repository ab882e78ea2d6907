/**
 * `npm test`: one `treadle serve` for the whole suite, then `node --test` over the
 * compiled test files, one file at a time (the machine's cores are the server's).
 */
import { spawn } from "node:child_process";
import { readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { startServer } from "./harness.js";

const here = dirname(fileURLToPath(import.meta.url));
const only = process.argv.slice(2);
const files = readdirSync(here)
  .filter((f) => f.endsWith(".test.js"))
  .filter((f) => only.length === 0 || only.some((o) => f.includes(o)))
  .map((f) => join(here, f));

const server = await startServer();
let code = 1;
try {
  const child = spawn(process.execPath, ["--test", "--test-concurrency=1", ...files], {
    stdio: "inherit",
    env: {
      ...process.env,
      TREADLE_TEST_ADDRESS: server.address,
      TREADLE_TEST_API_KEY: server.apiKey,
      TREADLE_TEST_DATA_DIR: server.dataDir,
    },
  });
  code = await new Promise<number>((r) => child.once("exit", (c) => r(c ?? 1)));
} finally {
  await server.stop();
}
process.exit(code);
