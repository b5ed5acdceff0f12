// A grpc-js client of tokenwire.v1.TextGeneration: runs the calls named on the command
// line against TARGET and prints one JSON line per call. tests/test_grpc_js.py checks them.
//   node client.mjs 127.0.0.1:50051 '{"one": {"prompt": "hi"}}'
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const definition = protoLoader.loadSync(path.join(here, "../../proto/tokenwire/v1/generation.proto"), {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: false,
  oneofs: true,
});
const { TextGeneration } = grpc.loadPackageDefinition(definition).tokenwire.v1;
// argv: TARGET and a JSON object {name: GenerateRequest in the proto's JSON field names}.
const [target, requestsJson] = process.argv.slice(2);
const requests = JSON.parse(requestsJson);
const client = new TextGeneration(target, grpc.credentials.createInsecure());

function generate(request) {
  return new Promise((resolve) => {
    const chunks = [];
    const call = client.Generate(request, { deadline: Date.now() + 120_000 });
    call.on("data", (chunk) => chunks.push(chunk));
    call.on("error", (error) => resolve({ chunks, code: grpc.status[error.code], details: error.details }));
    call.on("end", () => resolve({ chunks, code: "OK" }));
  });
}

for (const [name, request] of Object.entries(requests)) {
  const result = await generate(request);
  const last = result.chunks.at(-1) ?? {};
  console.log(
    JSON.stringify({
      name,
      code: result.code,
      details: result.details ?? "",
      text: result.chunks.map((c) => c.text ?? "").join(""),
      ids: result.chunks.flatMap((c) => (c.tokens ?? []).map((t) => t.id)),
      indexes: result.chunks.map((c) => c.index ?? 0),
      finish_reason: last.finish_reason ?? "",
      completion_tokens: last.usage?.completion_tokens ?? 0,
    }),
  );
}
client.close();
