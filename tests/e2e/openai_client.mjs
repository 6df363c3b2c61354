// End-to-end: the official `openai` npm client against `moestream serve` on the serve fixture.
// With temperature 0 the replies must equal transformers' greedy continuations (ref.json), plain
// and streamed; bad requests must surface as the client's typed 4xx errors.
//
//   node tests/e2e/openai_client.mjs path/to/moestream
import assert from 'node:assert/strict';
import fs from 'node:fs';
import OpenAI from 'openai';
import { fixtureCopy, startServe } from './serve_fixture.mjs';

const binary = process.argv[2];
if (!binary) throw new Error('usage: node openai_client.mjs MOESTREAM_BINARY');
const { dir, ref } = fixtureCopy('moestream-e2e-');
const key = 'e2e-key';
const { server, port } = await startServe(binary, dir, ['--name', 'tiny', '--api-key', key, '--ctx', '1024']);

let checks = 0;
try {
  const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: key, maxRetries: 0 });

  const models = await client.models.list();
  assert.equal(models.data[0].id, 'tiny');
  checks++;

  for (const c of ref.cases) {
    const request = { model: 'tiny', messages: c.messages, temperature: 0, max_tokens: 16 };
    if (c.tools) request.tools = c.tools;
    const r = await client.chat.completions.create(request);
    assert.equal(r.choices[0].message.content, c.reply, `${c.name}: plain reply`);
    assert.equal(r.usage.prompt_tokens, c.prompt_ids.length, `${c.name}: prompt tokens`);
    checks++;

    const stream = await client.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let usage = null;
    let finish = null;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      if (chunk.choices.length === 0) continue;
      text += chunk.choices[0].delta.content ?? '';
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    assert.equal(text, c.reply, `${c.name}: streamed reply`);
    assert.equal(usage.completion_tokens, c.greedy_ids.length, `${c.name}: streamed usage`);
    assert.ok(finish === 'length' || finish === 'stop', `${c.name}: finish_reason ${finish}`);
    checks++;
  }

  const completion = await client.completions.create({ model: 'tiny', prompt: ref.cases[0].prompt, max_tokens: 16, temperature: 0 });
  assert.equal(completion.choices[0].text, ref.cases[0].reply);
  checks++;

  await assert.rejects(
    client.chat.completions.create({ model: 'tiny', messages: ref.cases[0].messages, temperature: 'hot' }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && /temperature/.test(e.message));
  checks++;
  await assert.rejects(
    client.chat.completions.create({ model: 'tiny', messages: [], max_tokens: 4 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400);
  checks++;
  const intruder = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(intruder.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  checks++;
  console.log(`openai npm client against moestream serve: ${checks} checks passed`);
} finally {
  server.kill('SIGTERM');
  fs.rmSync(dir, { recursive: true, force: true });
}
