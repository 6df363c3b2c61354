// What the end-to-end tests share: the serve fixture (a tiny Qwen3-MoE chat model and
// transformers' greedy replies, ref.json) copied with the Qwen3 tokenizer beside it (scripts/setup
// fetches it into .cache/), and `moestream serve` started on a free port.
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');

export function fixtureCopy(prefix) {
  const fixture = path.join(root, 'tests/fixtures/serve/qwen3_tiny_chat');
  const ref = JSON.parse(fs.readFileSync(path.join(fixture, 'ref.json'), 'utf8'));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), prefix));
  process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }));
  fs.cpSync(fixture, dir, { recursive: true });
  fs.copyFileSync(path.join(root, '.cache/tokenizer-qwen3/tokenizer.json'), path.join(dir, 'tokenizer.json'));
  return { dir, ref };
}

// Starts `binary serve -m dir --port 0 ...args` and resolves with the process and the port it
// printed.
export async function startServe(binary, dir, args) {
  const server = spawn(binary, ['serve', '-m', dir, '--port', '0', ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const port = await new Promise((resolve, reject) => {
    server.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) resolve(Number(m[1]));
    });
    server.on('exit', (code) => reject(new Error(`server exited (${code}): ${log}`)));
    setTimeout(() => reject(new Error(`server did not start: ${log}`)), 120000).unref();
  });
  return { server, port };
}
