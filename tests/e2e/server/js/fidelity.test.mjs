// E2B behaviours the JS SDK relies on (issue 14): key format, signed URLs
// that name no sandbox, pause without memory.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Sandbox } from 'e2b'
import { newSandbox } from './helpers.mjs'

test('the API key has the shape of an E2B key', () => {
  assert.match(process.env.E2B_API_KEY, /^e2b_[0-9a-f]{40}$/)
})

test('signed URLs without a sandbox id: served, or refused with envd messages', async () => {
  const sbx = await newSandbox()
  try {
    await sbx.files.write('/tmp/js-signed.txt', 'js signed')
    const url = await sbx.downloadUrl('/tmp/js-signed.txt', { useSignatureExpiration: 10_000 })
    assert.ok(!new URL(url).pathname.includes(sbx.sandboxId))
    let res = await fetch(url)
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'js signed')

    res = await fetch(await sbx.downloadUrl('/tmp/js-signed.txt', { useSignatureExpiration: -10_000 }))
    assert.equal(res.status, 401)
    assert.deepEqual(await res.json(), { code: 401, message: 'signature is already expired' })

    res = await fetch(url.replace('signature=v1_', 'signature=v1_x'))
    assert.equal(res.status, 401)
    assert.deepEqual(await res.json(), { code: 401, message: 'invalid signature' })

    const up = await sbx.uploadUrl('/tmp/js-up.txt')
    const form = new FormData()
    form.append('file', new Blob(['js uploaded']), 'js-up.txt')
    res = await fetch(up, { method: 'POST', body: form })
    assert.equal(res.status, 200)
    assert.equal(await sbx.files.read('/tmp/js-up.txt'), 'js uploaded')
  } finally {
    await sbx.kill()
  }
})

test('pause without memory: connect cold-boots, files and identity kept', async () => {
  const sbx = await newSandbox()
  try {
    await sbx.files.write('/home/user/js-kept.txt', 'kept')
    const boot = (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
    await Sandbox.pause(sbx.sandboxId, { keepMemory: false })
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const back = await Sandbox.connect(sbx.sandboxId)
    assert.equal(back.sandboxId, sbx.sandboxId)
    assert.equal(await back.files.read('/home/user/js-kept.txt'), 'kept')
    assert.notEqual((await back.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout, boot)
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})
