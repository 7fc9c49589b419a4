// Calls tandem.v1.Inference from Node: one unary and one streaming chat completion.
// Usage: node chat.js HOST:PORT PROTO_DIR GOOGLEAPIS_DIR "message"
// (google.protobuf.Value keeps its camelCase field names in proto-loader, whatever keepCase says.)
// Prints one JSON line: {"unary": "...", "streamed": "...", "chunks": N, "usage": {...}}.
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, protoDir, googleapisDir, message] = process.argv.slice(2);
const definition = protoLoader.loadSync("tandem/v1/inference.proto", {
  includeDirs: [protoDir, googleapisDir],
  keepCase: true,
  defaults: true,
  oneofs: true,
});
const { Inference } = grpc.loadPackageDefinition(definition).tandem.v1;
const client = new Inference(address, grpc.credentials.createInsecure());
const request = {
  messages: [{ role: "user", content: { stringValue: message } }],
  max_tokens: 12,
  temperature: 0,
};
const deadline = () => new Date(Date.now() + 30000);

client.CreateChatCompletion(request, { deadline: deadline() }, (err, reply) => {
  if (err) throw err;
  let streamed = "";
  let chunks = 0;
  const call = client.StreamChatCompletion(request, { deadline: deadline() });
  call.on("data", (chunk) => {
    chunks += 1;
    if (chunk.choices.length) streamed += chunk.choices[0].delta.content;
  });
  call.on("error", (e) => { throw e; });
  call.on("end", () => {
    console.log(JSON.stringify({
      unary: reply.choices[0].message.content.stringValue,
      streamed,
      chunks,
      usage: reply.usage,
    }));
    client.close();
  });
});
