// E2B behaviours the JS SDK relies on: key format, signed URLs that name no
// sandbox, pause without memory, files as envd serves them, a killed
// sandbox's streams and ports. run.sh runs this file under every pinned JS
// SDK (tests/e2e/js and tests/e2e/js-2.45).
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

test('files outside home as the default user, owned by the user; procfs read to its end', async () => {
  const sbx = await newSandbox()
  try {
    await sbx.files.write('/0/js-notes.txt', 'notes')
    await sbx.files.write('/etc/js-app.conf', 'conf')
    await sbx.files.makeDir('/workspace/js')
    for (const p of ['/0', '/0/js-notes.txt', '/etc/js-app.conf', '/workspace/js']) {
      assert.equal((await sbx.files.getInfo(p)).owner, 'user', p)
    }
    await sbx.files.rename('/etc/js-app.conf', '/opt/js/app.conf')
    assert.equal(await sbx.files.read('/opt/js/app.conf'), 'conf')
    await sbx.files.remove('/opt/js')
    assert.equal(await sbx.files.exists('/opt/js'), false)
    const boot = (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
    assert.equal(await sbx.files.read('/proc/sys/kernel/random/boot_id'), boot)
    assert.equal(await sbx.files.read('/sys/class/net/lo/address'), '00:00:00:00:00:00\n')
    const r = await sbx.commands.run('touch /etc/js-by-user 2>&1; echo rc=$?')
    assert.match(r.stdout, /Permission denied[\s\S]*rc=1/)
  } finally {
    await sbx.kill()
  }
})

test('a killed sandbox ends a waited command with "killed or reached its end of life"', async () => {
  const sbx = await newSandbox()
  const h = await sbx.commands.run('sleep 300', { background: true })
  setTimeout(() => Sandbox.kill(sbx.sandboxId), 1000)
  await assert.rejects(h.wait(), (err) => {
    assert.match(String(err.message), /The sandbox was killed or reached its end of life/)
    return true
  })
})

test('a killed sandbox\'s port answers E2B\'s 502 body', async () => {
  const sbx = await newSandbox()
  const id = sbx.sandboxId
  await sbx.kill()
  const res = await fetch(`${process.env.E2B_SANDBOX_URL}/health`, { headers: { 'E2b-Sandbox-Id': id } })
  assert.equal(res.status, 502)
  assert.deepEqual(await res.json(), { message: 'The sandbox was not found', sandboxId: id, code: 502 })
})
