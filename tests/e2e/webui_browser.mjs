// End-to-end: the web chat page of `moestream serve` in a real headless Chromium (Debian's
// package, driven by puppeteer-core). The server runs the serve fixture with an API key; the page
// is given the key in its settings, sends a message, and must show the streamed greedy reply that
// transformers produced (ref.json), with its statistics; Stop ends a long reply; the conversation
// survives a reload.
//
//   node tests/e2e/webui_browser.mjs path/to/moestream [path/to/chromium]
import assert from 'node:assert/strict';
import path from 'node:path';
import puppeteer from 'puppeteer-core';
import { fixtureCopy, startServe } from './serve_fixture.mjs';

const binary = process.argv[2];
const chromium = process.argv[3] ?? '/usr/bin/chromium';
if (!binary) throw new Error('usage: node webui_browser.mjs MOESTREAM_BINARY [CHROMIUM]');
const { dir, ref } = fixtureCopy('moestream-webui-');
const key = 'webui-key';
const { server, port } = await startServe(binary, dir, ['--name', 'tiny', '--api-key', key, '-c', '2048']);

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', `--user-data-dir=${path.join(dir, 'profile')}`],
});
let checks = 0;
try {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  if (process.env.WEBUI_DEBUG) page.on('request', (r) => { if (r.method() === 'POST') console.error(r.url(), r.postData()); });
  await page.goto(`http://127.0.0.1:${port}/`, { waitUntil: 'load' });
  assert.equal(await page.title(), 'moestream');
  // Without the key the page says what to do.
  await page.waitForFunction(() => document.getElementById('model').textContent.includes('API key'));
  checks++;

  // Settings: the key, greedy, the fixture's reply length.
  await page.click('#settings-button');
  const set = async (id, value) => {
    await page.$eval(id, (el, v) => { el.value = v; el.dispatchEvent(new Event('change')); }, String(value));
  };
  await set('#api-key', key);
  await set('#temperature', 0);
  await set('#max-tokens', 16);
  await page.click('#settings-button');
  await page.reload({ waitUntil: 'load' });
  await page.waitForFunction(() => document.getElementById('model').textContent === 'tiny');
  checks++;

  // A message; the reply streams in and equals transformers' greedy reply.
  const hello = ref.cases.find((c) => c.name === 'hello');
  await page.type('#input', hello.messages[0].content);
  await page.keyboard.press('Enter');
  await page.waitForFunction(() => document.querySelector('.msg.assistant .stats'), { timeout: 60000 });
  const reply = await page.$eval('.msg.assistant .content', (el) => el.textContent);
  assert.equal(reply, hello.reply, 'the streamed reply');
  const stats = await page.$eval('.msg.assistant .stats', (el) => el.textContent);
  assert.match(stats, new RegExp(`^${hello.greedy_ids.length} tokens`), stats);
  assert.match(stats, /tok\/s/, stats);
  assert.match(stats, /expert hit rate/, stats);
  assert.equal(await page.$eval('#send', (el) => el.textContent), 'Send');
  checks++;

  // The conversation is kept across a reload, in the list and on the page.
  await page.reload({ waitUntil: 'load' });
  assert.equal(await page.$eval('.msg.assistant .content', (el) => el.textContent), hello.reply);
  assert.equal(await page.$eval('#conversations li.active span', (el) => el.textContent), hello.messages[0].content.slice(0, 40));
  checks++;

  // Stop: a long reply in a new conversation, stopped after it has started.
  // The click happens in the page as soon as text shows: on a busy 2-core machine a round trip
  // through puppeteer can take longer than the whole reply. It is made by a MutationObserver,
  // whose callback runs between the reply's chunks: a timer polling the page can be held off
  // until the page has drained the whole stream (when it falls behind the server), and a click
  // then finds the reply finished.
  await set('#max-tokens', 2000);
  await page.click('#new-chat');
  await page.evaluate(() => {
    window.stopLabel = null;
    const observer = new MutationObserver(() => {
      if ((document.querySelector('.msg.assistant .content')?.textContent.length ?? 0) <= 20) return;
      observer.disconnect();
      const send = document.getElementById('send');
      window.stopLabel = send.textContent;
      send.click();
    });
    observer.observe(document.getElementById('messages'), { childList: true, subtree: true, characterData: true });
  });
  await page.type('#input', 'Tell me a long story.');
  await page.keyboard.press('Enter');
  const button = await page.waitForFunction(() => window.stopLabel, { polling: 10, timeout: 60000 });
  assert.equal(await button.jsonValue(), 'Stop');
  await page.waitForFunction(() => document.querySelector('.msg.assistant .stats'), { timeout: 30000 });
  assert.match(await page.$eval('.msg.assistant .stats', (el) => el.textContent), /stopped/);
  assert.equal(await page.$$eval('#conversations li', (els) => els.length), 2);
  checks++;

  assert.deepEqual(errors, [], 'no script errors on the page');
  checks++;
} finally {
  await browser.close();
  server.kill('SIGTERM');
}
console.log(`${checks} passed, 0 failed`);
