import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, AuthenticationError } from 'e2b'
import { AGENT } from './helpers.mjs'

test('access token set by /init is required and enforced', async () => {
  const token = 'tine-e2e-js-token'
  const init = (body, headers = {}) =>
    fetch(`${AGENT}/init`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) })
  assert.equal((await init({ accessToken: token })).status, 204)
  try {
    const sbx = await Sandbox.create()
    await assert.rejects(sbx.commands.run('true'), AuthenticationError)
    await assert.rejects(sbx.files.list('/'), AuthenticationError)
    const r = await fetch(`${AGENT}/process.Process/List`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-access-token': token }, body: '{}' })
    assert.equal(r.status, 200)
    assert.ok(Array.isArray((await r.json()).processes))
    assert.equal((await fetch(`${AGENT}/health`)).status, 204)
  } finally {
    assert.equal((await init({ accessToken: '' }, { 'x-access-token': token })).status, 204)
  }
  assert.equal((await fetch(`${AGENT}/envs`)).status, 200)
})
