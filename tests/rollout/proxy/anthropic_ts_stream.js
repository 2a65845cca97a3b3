// The official TypeScript SDK, streaming with thinking on, as its docs write it: every event it
// parses, then the message it assembles (one JSON line each). Run by test_thinking.py.
const Anthropic = require("@anthropic-ai/sdk");

async function main() {
  const [baseURL, body] = [process.argv[2], JSON.parse(process.argv[3])];
  const client = new Anthropic({ baseURL, apiKey: "x", maxRetries: 0 });
  const stream = client.messages.stream(body);
  for await (const event of stream) {
    console.log(JSON.stringify({ event: event.type, delta: event.delta ? event.delta.type : null }));
  }
  console.log(JSON.stringify({ final: await stream.finalMessage() }));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
