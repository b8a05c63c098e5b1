// Domain mode over HTTPS with the JS SDK: only E2B_DOMAIN, E2B_API_KEY and
// NODE_EXTRA_CA_CERTS (tine's CA) are set.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Sandbox } from 'e2b'

const domain = process.env.E2B_DOMAIN

test('the JS SDK works with only the domain', async () => {
  assert.ok(domain && !process.env.E2B_API_URL && !process.env.E2B_SANDBOX_URL)
  const sbx = await Sandbox.create({ metadata: { 'tine-e2e': 'domain' } })
  try {
    const r = await sbx.commands.run('echo js-over-tls')
    assert.equal(r.stdout, 'js-over-tls\n')
    await sbx.files.write('/tmp/j.txt', 'js-domain')
    assert.equal(await sbx.files.read('/tmp/j.txt'), 'js-domain')
    const url = await sbx.downloadUrl('/tmp/j.txt', { useSignatureExpiration: 60_000 })
    assert.ok(url.startsWith(`https://49983-${sbx.sandboxId}.${domain}/`), url)
    const res = await fetch(url)
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'js-domain')
    assert.equal(sbx.getHost(8000), `8000-${sbx.sandboxId}.${domain}`)
  } finally {
    await sbx.kill()
  }
})
