#!/usr/bin/env node
// Streams one completion from a nanovllm router with the Node.js gRPC stack, loading the public proto
// straight from protos/ (no generated code), and prints what it got as one line of JSON on stdout:
//   {"text", "token_ids", "finish_reason", "usage", "responses"}
// Used by tests/test_node_client.py to check that a client in another language sees what Python sees.
//
// Usage: node generate_client.js ROUTER_ADDRESS PROTO_ROOT
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const DEADLINE_MS = 100 * 1000; // below the Python test's 120 s subprocess timeout

function fail(message) {
  process.stderr.write(`generate_client: ${message}\n`);
  process.exit(1);
}

function main(argv) {
  if (argv.length !== 2) {
    fail("usage: node generate_client.js ROUTER_ADDRESS PROTO_ROOT");
  }
  const [address, protoRoot] = argv;

  const definition = protoLoader.loadSync("nanovllm/v1/generate.proto", {
    keepCase: true,
    enums: String,
    longs: Number,
    defaults: true,
    oneofs: true,
    includeDirs: [path.resolve(protoRoot)],
  });
  const v1 = grpc.loadPackageDefinition(definition).nanovllm.v1;
  const client = new v1.Generation(address, grpc.credentials.createInsecure());

  const request = {
    text: "The quick brown fox",
    sampling: { temperature: 0, max_tokens: 128 },
    return_token_ids: true,
  };
  const call = client.Generate(request, { deadline: Date.now() + DEADLINE_MS });

  let text = "";
  const tokenIds = [];
  let finishReason = "FINISH_REASON_UNSPECIFIED";
  let usage = null;
  let responses = 0;

  call.on("data", (response) => {
    responses += 1;
    text += response.text;
    tokenIds.push(...response.token_ids);
    if (response.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      finishReason = response.finish_reason;
    }
    if (response.usage !== null && response.usage !== undefined) {
      usage = response.usage;
    }
  });
  call.on("error", (err) => {
    client.close();
    const code = grpc.status[err.code] !== undefined ? grpc.status[err.code] : err.code;
    fail(`Generate failed: ${code}: ${err.details || err.message}`);
  });
  call.on("end", () => {
    client.close();
    process.stdout.write(
      JSON.stringify({ text, token_ids: tokenIds, finish_reason: finishReason, usage, responses }) + "\n",
    );
  });
}

main(process.argv.slice(2));
