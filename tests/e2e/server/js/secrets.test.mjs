// Secrets through the JS SDK: one secret, a header transform that names
// it, the stand-in internet (tests/e2e/net/inet.sh) receiving it over
// HTTPS (its /headers answers each header's SHA-256), and an update that
// the next request carries.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { Sandbox, Secret } from 'e2b'
import { tagged } from './helpers.mjs'

const HOST = 'api.inet.test'
const sha = (v) => createHash('sha256').update(v).digest('hex')

async function seen(sbx) {
  const r = await sbx.commands.run(`curl -sS -m 20 https://${HOST}/headers`, { timeoutMs: 60_000 })
  return JSON.parse(r.stdout)
}

test('a secret in a header transform reaches the destination, not the guest', { timeout: 300_000 }, async () => {
  const name = `js-${randomBytes(5).toString('hex')}`
  const value = `sk-${randomBytes(16).toString('hex')}`
  const info = await Secret.create(name, value, { metadata: { from: 'js' } })
  assert.equal(info.version, 1)
  const sbx = await Sandbox.create({
    metadata: tagged(),
    network: {
      rules: { [HOST]: [{ transform: { headers: { Authorization: `Bearer ${Secret.fill(name)}` } } }] },
    },
  })
  try {
    assert.deepEqual((await seen(sbx)).authorization, [sha(`Bearer ${value}`)])
    const env = await sbx.commands.run('env')
    assert.ok(!env.stdout.includes(value))
    const up = await Secret.update(name, `${value}-2`)
    assert.equal(up.version, 2)
    assert.deepEqual((await seen(sbx)).authorization, [sha(`Bearer ${value}-2`)])
  } finally {
    await sbx.kill()
    assert.equal(await Secret.destroy(name), true)
  }
  assert.equal(await Secret.exists(name), false)
})
