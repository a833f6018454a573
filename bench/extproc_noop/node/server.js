// Do-nothing ext-proc server on Node.js @grpc/grpc-js: the message sequence of kvgate's EPP (epp/extproc.py), every
// request sent to one --destination, nothing parsed — the Node twin of ../replies.py. The message types come from a
// FileDescriptorSet the bench writes from the installed Python protos (../descriptors.py), so no .proto files ship.
"use strict";

const fs = require("fs");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const DESTINATION_HEADER = "x-gateway-destination-endpoint";
const DESTINATION_NAMESPACE = "envoy.lb";
const FULL_DUPLEX = "FULL_DUPLEX_STREAMED";

function flag(name) {
  const i = process.argv.indexOf(name);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`missing ${name}`);
  return process.argv[i + 1];
}

const port = flag("--port");
const destination = flag("--destination");
const definition = protoLoader.loadFileDescriptorSetFromBuffer(fs.readFileSync(flag("--descriptors")), {
  keepCase: true, longs: String, enums: String, defaults: false, oneofs: true,
});
const service = grpc.loadPackageDefinition(definition).envoy.service.ext_proc.v3.ExternalProcessor.service;

const common = {
  header_mutation: {set_headers: [{header: {key: DESTINATION_HEADER, raw_value: Buffer.from(destination)}}]},
  clear_route_cache: true,
};
// a map field from a descriptor set is its repeated entry message to protobufjs: [{key, value}]
const metadata = {fields: [{key: DESTINATION_NAMESPACE, value: {struct_value: {fields: [
  {key: DESTINATION_HEADER, value: {string_value: destination}}]}}}]};
const routed = {request_headers: {response: common}, dynamic_metadata: metadata};

function streamed(body, endOfStream) {
  return {response: {body_mutation: {streamed_response: {body: body, end_of_stream: endOfStream}}}};
}

function process_(call) {
  let requestFullDuplex = false;
  let responseFullDuplex = false;
  let decided = false;
  let chunks = [];
  const decide = (endOfStream) => {
    decided = true;
    const body = Buffer.concat(chunks);
    chunks = [];
    if (requestFullDuplex) {
      call.write(routed);
      call.write({request_body: streamed(body, endOfStream)});
    } else {
      call.write({request_body: {response: common}, dynamic_metadata: metadata});
    }
  };
  call.on("data", (msg) => {
    if (msg.protocol_config) {
      requestFullDuplex = msg.protocol_config.request_body_mode === FULL_DUPLEX;
      responseFullDuplex = msg.protocol_config.response_body_mode === FULL_DUPLEX;
    }
    switch (msg.request) {
      case "request_headers":
        if (msg.request_headers.end_of_stream) {
          decided = true;
          call.write(routed);
        } else if (!requestFullDuplex) {
          call.write({request_headers: {}});
        }
        break;
      case "request_body":
        if (decided) break;
        if (msg.request_body.body) chunks.push(msg.request_body.body);
        if (msg.request_body.end_of_stream || !requestFullDuplex) decide(Boolean(msg.request_body.end_of_stream));
        break;
      case "request_trailers":
        if (!decided) decide(false);
        call.write({request_trailers: {}});
        break;
      case "response_headers":
        call.write({response_headers: {}});
        break;
      case "response_body":
        call.write({response_body: responseFullDuplex
          ? streamed(msg.response_body.body || Buffer.alloc(0), Boolean(msg.response_body.end_of_stream)) : {}});
        break;
      case "response_trailers":
        call.write({response_trailers: {}});
        break;
    }
  });
  call.on("end", () => call.end());
  call.on("error", () => {});
}

const server = new grpc.Server();
server.addService(service, {Process: process_});
server.bindAsync(`127.0.0.1:${port}`, grpc.ServerCredentials.createInsecure(), (err) => {
  if (err) {
    console.error(err);
    process.exit(1);
  }
});
