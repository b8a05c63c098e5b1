// Volumes through the JS SDK: create, the content API, list, destroy, and
// mounted into sandboxes.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Volume } from 'e2b'
import { RUN, newSandbox } from './helpers.mjs'

test('Volume: create, write, read, list, remove, destroy', async () => {
  const vol = await Volume.create(`e2e-js-${RUN}`)
  try {
    assert.ok(vol.volumeId && vol.token)
    const e = await vol.writeFile('/js/hello.txt', `hello ${RUN}`)
    assert.equal(e.path, '/js/hello.txt')
    assert.equal(e.size, `hello ${RUN}`.length)
    assert.equal(await vol.readFile('/js/hello.txt'), `hello ${RUN}`)
    const bytes = new Uint8Array(300_000).map((_, i) => i % 251)
    await vol.writeFile('/js/bytes.bin', bytes)
    assert.deepEqual(new Uint8Array(await vol.readFile('/js/bytes.bin', { format: 'bytes' })), bytes)
    const names = (await vol.list('/js')).map((x) => x.name).sort()
    assert.deepEqual(names, ['bytes.bin', 'hello.txt'])
    const dir = await vol.makeDir('/x/y', { force: true })
    assert.equal(dir.type, 'directory')
    assert.equal((await vol.updateMetadata('/js/hello.txt', { mode: 0o600 })).mode, 0o600)
    await vol.remove('/js')
    assert.equal(await vol.exists('/js/hello.txt'), false)
    const listed = await Volume.list()
    assert.ok(listed.some((v) => v.volumeId === vol.volumeId))
    const info = await Volume.getInfo(vol.volumeId)
    assert.equal(info.token, vol.token)
  } finally {
    assert.equal(await Volume.destroy(vol.volumeId), true)
  }
  await assert.rejects(Volume.getInfo(vol.volumeId), /not found/i)
})

test('Volume mounted into two sandboxes: shared live, destroy refused while mounted', async () => {
  const vol = await Volume.create(`e2e-js-mnt-${RUN}`)
  const made = []
  try {
    await vol.writeFile('/hello.txt', `hello ${RUN}`)
    for (let i = 0; i < 2; i++) {
      made.push(await newSandbox({ volumeMounts: { '/mnt/data': vol }, timeoutMs: 600_000 }))
    }
    const [a, b] = made
    assert.equal((await a.commands.run('cat /mnt/data/hello.txt')).stdout, `hello ${RUN}`)
    assert.deepEqual((await a.getInfo()).volumeMounts, [{ name: vol.name, path: '/mnt/data' }])
    await a.commands.run('echo from-a > /mnt/data/a.txt')
    let got = ''
    for (let i = 0; i < 60 && got !== 'from-a\n'; i++) {
      got = (await b.commands.run('cat /mnt/data/a.txt 2>/dev/null || true')).stdout
      if (got !== 'from-a\n') await new Promise((r) => setTimeout(r, 300))
    }
    assert.equal(got, 'from-a\n')
    assert.equal(await vol.readFile('/a.txt'), 'from-a\n')
    await assert.rejects(Volume.destroy(vol.volumeId), /mounted/)
  } finally {
    for (const s of made) await s.kill().catch(() => {})
    assert.equal(await Volume.destroy(vol.volumeId), true)
  }
})
