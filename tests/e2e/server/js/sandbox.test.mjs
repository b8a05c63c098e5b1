// The real JS SDK against `tine serve`: create, commands.run, files,
// list, connect and kill.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { AuthenticationError, CommandExitError, NotFoundError, Sandbox } from 'e2b'

import { RUN, newSandbox, listAll, tagged } from './helpers.mjs'

const made = []
after(async () => {
  for (const s of made) await s.kill().catch(() => {})
})

async function make(opts) {
  const s = await newSandbox(opts)
  made.push(s)
  return s
}

test('create and commands.run', async () => {
  const s = await make({ envs: { FROM_CREATE: 'js-env' } })
  assert.ok(s.sandboxId)
  const r = await s.commands.run('echo out; echo err >&2; echo $FROM_CREATE')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'out\njs-env\n')
  assert.equal(r.stderr, 'err\n')
  await assert.rejects(s.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)
  const bg = await s.commands.run('sleep 0.3; echo bg', { background: true })
  const done = await bg.wait()
  assert.equal(done.stdout, 'bg\n')
  const info = await s.getInfo()
  assert.equal(info.sandboxId, s.sandboxId)
  assert.equal(info.templateId, 'base')
  assert.equal(info.state, 'running')
  assert.equal(info.cpuCount, 1)
  assert.equal(info.memoryMB, 256)
  assert.deepEqual(info.metadata, tagged())
})

test('files write and read', async () => {
  const s = await make()
  const dir = `/tmp/tine-e2e-js-${RUN}`
  await s.files.write(`${dir}/a.txt`, 'hello from js\n')
  assert.equal(await s.files.read(`${dir}/a.txt`), 'hello from js\n')
  const bytes = new Uint8Array(70000).map((_, i) => (i * 7) % 256)
  await s.files.write(`${dir}/b.bin`, bytes.buffer)
  const back = await s.files.read(`${dir}/b.bin`, { format: 'bytes' })
  assert.deepEqual(Buffer.from(back), Buffer.from(bytes))
  const names = (await s.files.list(dir)).map((e) => e.name).sort()
  assert.deepEqual(names, ['a.txt', 'b.bin'])
  assert.equal((await s.commands.run(`cat ${dir}/a.txt`)).stdout, 'hello from js\n')
})

test('list with metadata, state and paging', async () => {
  const group = { group: 'js-list' }
  const a = await make({ metadata: group })
  const b = await make({ metadata: group })
  const query = { metadata: tagged(group) }
  const { items, pages } = await listAll({ query, limit: 1 })
  assert.deepEqual(pages, [1, 1])
  assert.deepEqual(items.map((i) => i.sandboxId).sort(), [a.sandboxId, b.sandboxId].sort())
  for (const i of items) {
    assert.equal(i.state, 'running')
    assert.equal(i.metadata.group, 'js-list')
  }
  const paused = await listAll({ query: { ...query, state: ['paused'] } })
  assert.equal(paused.items.length, 0)
  const none = await listAll({ query: { metadata: tagged({ group: 'nobody' }) } })
  assert.equal(none.items.length, 0)
})

test('connect to a running sandbox from a second handle', async () => {
  const s = await make()
  await s.files.write('/tmp/tine-e2e-js-connect', 'first handle')
  const other = await Sandbox.connect(s.sandboxId)
  assert.equal(other.sandboxId, s.sandboxId)
  assert.equal(await other.files.read('/tmp/tine-e2e-js-connect'), 'first handle')
  assert.equal((await other.commands.run('echo ok')).stdout, 'ok\n')
})

test('kill', async () => {
  const s = await make()
  assert.equal((await s.commands.run('true')).exitCode, 0)
  assert.equal(await s.kill(), true)
  assert.equal(await s.isRunning(), false)
  assert.equal(await Sandbox.kill(s.sandboxId), false)
  await assert.rejects(s.getInfo())
  const { items } = await listAll({ query: { metadata: tagged() } })
  assert.ok(!items.some((i) => i.sandboxId === s.sandboxId))
})

test('a wrong API key and an unknown sandbox', async () => {
  await assert.rejects(Sandbox.create({ apiKey: 'not-a-tine-key' }), AuthenticationError)
  await assert.rejects(Sandbox.getInfo('nosuchsandbox0000000'), NotFoundError)
  assert.equal(await Sandbox.kill('nosuchsandbox0000000'), false)
})
