import { test } from 'node:test'
import assert from 'node:assert/strict'
import { AGENT, envelope, frames } from './helpers.mjs'

test('health', async () => {
  assert.equal((await fetch(`${AGENT}/health`)).status, 204)
})

test('Start over raw Connect: start, data, end, end-of-stream', async () => {
  const res = await fetch(`${AGENT}/process.Process/Start`, {
    method: 'POST',
    headers: { 'content-type': 'application/connect+json', authorization: 'Basic ' + Buffer.from('root:').toString('base64') },
    body: envelope({ process: { cmd: '/bin/sh', args: ['-c', 'id -u; exit 4'] } }),
  })
  assert.equal(res.status, 200)
  const f = frames(Buffer.from(await res.arrayBuffer()))
  assert.ok(f[0][1].event.start.pid > 0)
  assert.equal(Buffer.from(f[1][1].event.data.stdout, 'base64').toString(), '0\n')
  assert.deepEqual(f.at(-2)[1].event.end, { exitCode: 4, exited: true, status: 'exit status 4', error: 'exit status 4' })
  assert.deepEqual(f.at(-1), [2, {}])
})

test('bad input gets Connect and HTTP errors', async () => {
  const post = (path, body, ct = 'application/json') => fetch(`${AGENT}${path}`, { method: 'POST', headers: { 'content-type': ct }, body })
  let r = await post('/filesystem.Filesystem/ListDir', '{"path":')
  assert.equal(r.status, 400)
  assert.equal((await r.json()).code, 'invalid_argument')
  r = await post('/filesystem.Filesystem/Frobnicate', '{}')
  assert.equal(r.status, 404)
  assert.equal((await r.json()).code, 'unimplemented')
  r = await post('/filesystem.Filesystem/MakeDir', JSON.stringify({ path: '/proc/tine-e2e' }))
  assert.ok([403, 404, 500].includes(r.status))
  r = await post('/process.Process/Start', Buffer.from([0, 0, 0, 0, 9, 0x7b]), 'application/connect+json')
  const f = frames(Buffer.from(await r.arrayBuffer()))
  assert.equal(f[0][1].error.code, 'invalid_argument')
  r = await fetch(`${AGENT}/files?path=/nonexistent-tine-js`)
  assert.equal(r.status, 404)
  assert.equal((await r.json()).code, 404)
})
