// Volumes through the JS SDK: create, the content API, list, destroy.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Volume } from 'e2b'
import { RUN } from './helpers.mjs'

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
