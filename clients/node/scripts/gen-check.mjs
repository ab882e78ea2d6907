// `npm run gen:check`: regenerate src/gen from ../../protos into a temporary
// directory and fail if the committed files differ (run `npm run gen` to update).
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";

const here = new URL("..", import.meta.url).pathname;
const tmp = mkdtempSync(join(tmpdir(), "treadle-gen-"));
const files = (dir) =>
  readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    return statSync(path).isDirectory() ? files(path) : [path];
  });
try {
  execFileSync(join(here, "node_modules", ".bin", "buf"), ["generate", "-o", tmp], { cwd: here, stdio: "inherit" });
  const fresh = join(tmp, "src", "gen");
  const committed = join(here, "src", "gen");
  const want = new Map(files(fresh).map((f) => [relative(fresh, f), readFileSync(f, "utf8")]));
  const have = new Map(files(committed).map((f) => [relative(committed, f), readFileSync(f, "utf8")]));
  const changed = [...want].filter(([f, text]) => have.get(f) !== text).map(([f]) => f);
  const stale = [...have.keys()].filter((f) => !want.has(f));
  if (changed.length || stale.length) {
    console.error(`src/gen drifts from the protos: changed=${changed} stale=${stale}; run npm run gen`);
    process.exit(1);
  }
  console.log(`src/gen matches the protos (${want.size} files)`);
} finally {
  rmSync(tmp, { recursive: true, force: true });
}
