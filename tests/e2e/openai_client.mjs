// End-to-end: the official `openai` npm client against `moestream serve` on the serve fixture.
// With temperature 0 the replies must equal transformers' greedy continuations (ref.json), plain
// and streamed; bad requests must surface as the client's typed 4xx errors. n choices, logprobs, a
// json_schema reply and a forced tool call come back in the shapes the client parses.
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

  // n choices with logprobs, plain and streamed.
  const c0 = ref.cases[0];
  const multi = await client.chat.completions.create({
    model: 'tiny', messages: c0.messages, temperature: 0, max_tokens: 16, n: 2, logprobs: true, top_logprobs: 2 });
  assert.equal(multi.choices.length, 2);
  for (const [i, ch] of multi.choices.entries()) {
    assert.equal(ch.index, i);
    assert.equal(ch.message.content, c0.reply, `choice ${i}`);
    assert.equal(ch.logprobs.content.length, c0.greedy_ids.length);
    for (const t of ch.logprobs.content) {
      assert.ok(t.logprob <= 0 && Number.isFinite(t.logprob));
      assert.equal(t.top_logprobs.length, 2);
      assert.equal(t.top_logprobs[0].logprob, t.logprob);  // greedy: the most likely token
      assert.ok(Array.isArray(t.bytes));
    }
  }
  checks++;
  const multiStream = await client.chat.completions.create({
    model: 'tiny', messages: c0.messages, temperature: 0, max_tokens: 16, n: 2, logprobs: true, stream: true });
  const texts = ['', ''];
  const streamedLogprobs = [0, 0];
  for await (const chunk of multiStream) {
    for (const ch of chunk.choices) {
      texts[ch.index] += ch.delta.content ?? '';
      streamedLogprobs[ch.index] += ch.logprobs?.content?.length ?? 0;
    }
  }
  assert.deepEqual(texts, [c0.reply, c0.reply]);
  assert.deepEqual(streamedLogprobs, [c0.greedy_ids.length, c0.greedy_ids.length]);
  checks++;

  // A json_schema reply, parsed by the client (constrained decoding makes even this random
  // model's output match the schema).
  const schema = {
    type: 'object',
    properties: {
      city: { type: 'string', maxLength: 20 },
      days: { type: 'integer' },
      unit: { type: 'string', enum: ['c', 'f'] },
      temps: { type: 'array', items: { type: 'number' }, maxItems: 3 },
    },
    required: ['city', 'days', 'unit', 'temps'],
    additionalProperties: false,
  };
  const parsed = await client.beta.chat.completions.parse({
    model: 'tiny', messages: c0.messages, temperature: 0, max_tokens: 1000,
    response_format: { type: 'json_schema', json_schema: { name: 'forecast', strict: true, schema } } });
  const forecast = parsed.choices[0].message.parsed;
  assert.equal(parsed.choices[0].finish_reason, 'stop');
  assert.equal(typeof forecast.city, 'string');
  assert.ok(forecast.city.length <= 20);
  assert.ok(Number.isInteger(forecast.days));
  assert.ok(['c', 'f'].includes(forecast.unit));
  assert.ok(Array.isArray(forecast.temps) && forecast.temps.length <= 3 && forecast.temps.every(Number.isFinite));
  assert.deepEqual(Object.keys(forecast).sort(), ['city', 'days', 'temps', 'unit']);
  checks++;

  // tool_choice "required": the reply is a call, its arguments parsed by the client.
  const toolCase = ref.cases.find((c) => c.tools);
  const strictTools = toolCase.tools.map((t) => ({ ...t, function: { ...t.function, strict: true } }));
  for (const tool_choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
    const called = await client.beta.chat.completions.parse({
      model: 'tiny', messages: toolCase.messages, tools: strictTools, tool_choice, temperature: 0, max_tokens: 600 });
    const choice = called.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.tool_calls.length, 1);
    const call = choice.message.tool_calls[0];
    assert.equal(call.function.name, 'get_weather');
    assert.equal(typeof call.function.parsed_arguments.city, 'string');
    if ('unit' in call.function.parsed_arguments) assert.ok(['c', 'f'].includes(call.function.parsed_arguments.unit));
    checks++;
  }

  await assert.rejects(
    client.chat.completions.create({ model: 'tiny', messages: c0.messages, n: 9 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'n');
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
