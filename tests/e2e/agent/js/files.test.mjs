import { test } from 'node:test'
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { Sandbox, FileType, NotFoundError } from 'e2b'
import { tmpName } from './helpers.mjs'

test('write, read, list, exists, getInfo, rename, makeDir, remove', async () => {
  const sbx = await Sandbox.create()
  const d = tmpName('files')
  await sbx.files.write(`${d}/a.txt`, 'hello')
  assert.equal(await sbx.files.read(`${d}/a.txt`), 'hello')
  const infos = await sbx.files.write([
    { path: `${d}/b.txt`, data: 'b' },
    { path: `${d}/sub/c.bin`, data: new Uint8Array([1, 2, 3]) },
  ])
  assert.deepEqual(infos.map((i) => i.name), ['b.txt', 'c.bin'])
  const listed = await sbx.files.list(d)
  assert.deepEqual(listed.map((e) => e.name).sort(), ['a.txt', 'b.txt', 'sub'])
  assert.equal(listed.find((e) => e.name === 'sub').type, FileType.DIR)
  const deep = await sbx.files.list(d, { depth: 2 })
  assert.ok(deep.some((e) => e.path === `${d}/sub/c.bin`))
  const info = await sbx.files.getInfo(`${d}/a.txt`)
  assert.equal(info.size, 5)
  assert.equal(info.owner, 'user')
  assert.equal(info.permissions, '-rw-r--r--')
  assert.equal(await sbx.files.exists(`${d}/a.txt`), true)
  assert.equal(await sbx.files.exists(`${d}/nope`), false)
  const moved = await sbx.files.rename(`${d}/a.txt`, `${d}/moved/a.txt`)
  assert.equal(moved.path, `${d}/moved/a.txt`)
  assert.equal(await sbx.files.makeDir(`${d}/m`), true)
  assert.equal(await sbx.files.makeDir(`${d}/m`), false)
  await assert.rejects(sbx.files.read(`${d}/missing`), NotFoundError)
  await sbx.files.remove(d)
  assert.equal(await sbx.files.exists(d), false)
})

test('binary round trip with checksum', async () => {
  const sbx = await Sandbox.create()
  const p = tmpName('bin')
  const data = randomBytes(3 << 20)
  await sbx.files.write(p, new Blob([data]))
  const got = Buffer.from(await sbx.files.read(p, { format: 'bytes' }))
  assert.equal(createHash('sha256').update(got).digest('hex'), createHash('sha256').update(data).digest('hex'))
  await sbx.files.remove(p)
})

test('watchDir streams events', async () => {
  const sbx = await Sandbox.create()
  const d = tmpName('watch')
  await sbx.files.makeDir(d)
  const events = []
  const w = await sbx.files.watchDir(d, (e) => events.push(e), { recursive: true })
  await sbx.files.write(`${d}/w.txt`, 'w')
  for (let i = 0; i < 100 && !events.some((e) => e.name === 'w.txt' && e.type === 'write'); i++) {
    await new Promise((r) => setTimeout(r, 100))
  }
  await w.stop()
  assert.ok(events.some((e) => e.name === 'w.txt' && e.type === 'create'))
  assert.ok(events.some((e) => e.name === 'w.txt' && e.type === 'write'))
  await sbx.files.remove(d)
})
