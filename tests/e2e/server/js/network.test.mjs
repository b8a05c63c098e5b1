// The network policy through the JS SDK: allowInternetAccess at create,
// then updateNetwork opening one address (tests/e2e/net/inet.sh is the
// stand-in internet; ../run.sh starts it).
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { ALL_TRAFFIC, Sandbox } from 'e2b'
import { tagged } from './helpers.mjs'

const INET = '203.0.113.10'
const INET2 = '203.0.113.20'

async function reaches(sbx, ip) {
  const r = await sbx.commands.run(`curl -s -o /dev/null --connect-timeout 3 -m 6 http://${ip}/; echo $?`)
  return r.stdout.trim() === '0'
}

test('allowInternetAccess false, then updateNetwork', { timeout: 300_000 }, async () => {
  const sbx = await Sandbox.create({ metadata: tagged(), allowInternetAccess: false })
  try {
    assert.equal(await reaches(sbx, INET), false)
    await sbx.updateNetwork({ allowOut: [INET], denyOut: [ALL_TRAFFIC] })
    assert.equal(await reaches(sbx, INET), true)
    assert.equal(await reaches(sbx, INET2), false)
    const info = await sbx.getInfo()
    assert.deepEqual(info.network?.allowOut, [INET])
    await sbx.updateNetwork({})
    assert.equal(await reaches(sbx, INET2), true)
  } finally {
    await sbx.kill()
  }
})
