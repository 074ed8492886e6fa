#!/usr/bin/env node
// A tandem.v1 client in Node.js, to show that clients in other languages work
// from nothing but protos/. Run by tests/integration/test_node_client.py.
//
//   node generate_client.js HOST:PORT "PROMPT" MAX_TOKENS
//
// Calls GetModelInfo, then a streamed greedy Generate (temperature 0), and
// prints one JSON line:
//   {"model_name", "text", "token_ids", "finish_reason", "chunks", "usage"}
// On a gRPC error it prints the error to stderr and exits non-zero.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "..", "protos");

function usage() {
  process.stderr.write("usage: node generate_client.js HOST:PORT PROMPT MAX_TOKENS\n");
  process.exit(2);
}

function loadGenerationService() {
  // google/protobuf/struct.proto is one of the well-known types that
  // proto-loader (protobufjs) ships, so only our own root is needed.
  const definition = protoLoader.loadSync("tandem/v1/generation.proto", {
    keepCase: true,
    longs: Number, // token ids and counts fit in a double
    enums: String, // finish_reason as its name
    defaults: true,
    oneofs: true,
    includeDirs: [PROTO_ROOT],
  });
  return grpc.loadPackageDefinition(definition).tandem.v1.Generation;
}

function getModelInfo(client, deadline) {
  return new Promise((resolve, reject) => {
    client.GetModelInfo({}, { deadline }, (err, info) => (err ? reject(err) : resolve(info)));
  });
}

function generate(client, request, deadline) {
  return new Promise((resolve, reject) => {
    const result = {
      text: "",
      token_ids: [],
      finish_reason: "FINISH_REASON_UNSPECIFIED",
      chunks: 0,
      usage: null,
    };
    const call = client.Generate(request, { deadline });
    call.on("data", (chunk) => {
      result.chunks += 1;
      result.text += chunk.text;
      for (const id of chunk.token_ids) result.token_ids.push(Number(id));
      result.finish_reason = chunk.finish_reason;
      if (chunk.usage) result.usage = chunk.usage;
    });
    call.on("error", reject);
    call.on("end", () => resolve(result));
  });
}

async function main() {
  const [target, prompt, maxTokensArg] = process.argv.slice(2);
  if (target === undefined || prompt === undefined || maxTokensArg === undefined) usage();
  const maxTokens = Number.parseInt(maxTokensArg, 10);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) usage();

  const Generation = loadGenerationService();
  const client = new Generation(target, grpc.credentials.createInsecure());
  const deadline = () => new Date(Date.now() + 100_000);
  try {
    const info = await getModelInfo(client, deadline());
    const result = await generate(
      client,
      { text: prompt, sampling: { max_tokens: maxTokens, temperature: 0 } },
      deadline(),
    );
    process.stdout.write(JSON.stringify({ model_name: info.model_name, ...result }) + "\n");
  } finally {
    client.close();
  }
}

main().catch((err) => {
  const code = err && err.code !== undefined ? ` (code ${err.code})` : "";
  process.stderr.write(`gRPC error${code}: ${err && err.message ? err.message : err}\n`);
  process.exit(1);
});
