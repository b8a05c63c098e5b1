import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, CommandExitError } from 'e2b'
import './helpers.mjs'

test('run foreground: stdout, stderr, exit code, default user', async () => {
  const sbx = await Sandbox.create()
  const r = await sbx.commands.run('echo out; echo err >&2; id -un')
  assert.equal(r.stdout, 'out\nuser\n')
  assert.equal(r.stderr, 'err\n')
  assert.equal(r.exitCode, 0)
})

test('non-zero exit rejects with CommandExitError', async () => {
  const sbx = await Sandbox.create()
  await assert.rejects(sbx.commands.run('echo x; exit 5'), (e) => e instanceof CommandExitError && e.exitCode === 5 && e.stdout === 'x\n')
})

test('run as root with envs and cwd', async () => {
  const sbx = await Sandbox.create()
  const r = await sbx.commands.run('id -u; echo $A; pwd', { user: 'root', envs: { A: 'b' }, cwd: '/tmp' })
  assert.deepEqual(r.stdout.split('\n').slice(0, 3), ['0', 'b', '/tmp'])
})

test('background, list, stdin, kill', async () => {
  const sbx = await Sandbox.create()
  const cat = await sbx.commands.run('cat', { background: true, stdin: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === cat.pid))
  await sbx.commands.sendStdin(cat.pid, 'via js\n')
  await sbx.commands.closeStdin(cat.pid)
  assert.equal((await cat.wait()).stdout, 'via js\n')

  const sleeper = await sbx.commands.run('sleep 300', { background: true })
  assert.equal(await sbx.commands.kill(sleeper.pid), true)
  await assert.rejects(sleeper.wait())
  assert.equal(await sbx.commands.kill(sleeper.pid), false)
})

test('connect from a second client', async () => {
  const sbx = await Sandbox.create()
  const h = await sbx.commands.run('for i in 1 2 3; do echo n$i; sleep 0.5; done', { background: true })
  const other = await Sandbox.connect('debug_sandbox_id')
  const h2 = await other.commands.connect(h.pid)
  const r2 = await h2.wait()
  assert.equal(r2.exitCode, 0)
  assert.match(r2.stdout, /n3\n$/)
  assert.equal((await h.wait()).stdout, 'n1\nn2\nn3\n')
})

test('pty create, resize, input', async () => {
  const sbx = await Sandbox.create()
  const chunks = []
  const t = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) })
  await sbx.pty.resize(t.pid, { cols: 101, rows: 33 })
  await sbx.pty.sendInput(t.pid, new TextEncoder().encode('stty size; exit\n'))
  const r = await t.wait()
  assert.equal(r.exitCode, 0)
  assert.match(Buffer.concat(chunks).toString(), /33 101/)
})
