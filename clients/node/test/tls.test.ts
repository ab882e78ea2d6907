/** TLS: a server started with --tls-cert/--tls-key (a self-signed certificate made
 * here with openssl) is reached with `rootCertificates`, and not without them. */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { ServiceClient, UnavailableError } from "../src/index.js";
import { startServer, TINY, type TestServer } from "./harness.js";

let server: TestServer;
let certPath = "";

before(async () => {
  server = await startServer({
    models: { [TINY]: "tiny" },
    extraArgs: (tmp) => {
      certPath = join(tmp, "server.crt");
      const key = join(tmp, "server.key");
      const made = spawnSync("openssl", [
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", certPath, "-days", "1", "-subj", "/CN=localhost",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
      ], { encoding: "utf8" });
      if (made.status !== 0) throw new Error(`openssl failed: ${made.stderr}`);
      return ["--tls-cert", certPath, "--tls-key", key];
    },
  });
});
after(async () => {
  await server.stop();
});

test("rootCertificates turns TLS on; a plaintext client cannot connect", async () => {
  const secure = new ServiceClient({
    address: server.address.replace("127.0.0.1", "localhost"),
    apiKey: server.apiKey,
    rootCertificates: readFileSync(certPath),
  });
  try {
    const info = await secure.getServerInfo();
    assert.deepEqual(info.baseModels.map((b) => b.name), [TINY]);
    const trainer = await secure.createLoraTrainingClient(TINY, { rank: 2 });
    const out = await trainer.forwardLogprobs([{ modelInput: [1, 5], lossFnInputs: { target_tokens: [5, 6] } }]);
    assert.equal(out.lossFnOutputs[0]!.logprobs.length, 2);
  } finally {
    secure.close();
  }
  const plain = new ServiceClient({ address: server.address, apiKey: server.apiKey, maxRetries: 0 });
  try {
    await assert.rejects(plain.getServerInfo(), UnavailableError);
  } finally {
    plain.close();
  }
});
