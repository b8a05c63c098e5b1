// Template builds through the JS SDK: one build (COPY from a context
// directory, RUN, ENV, WORKDIR, a start command) and a sandbox from it.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Sandbox, Template, waitForFile } from 'e2b'
import { RUN, tagged } from './helpers.mjs'

test('Template.build and Sandbox.create from it', { timeout: 600_000 }, async () => {
  const ctx = mkdtempSync(join(tmpdir(), 'tine-js-build-'))
  writeFileSync(join(ctx, 'note.txt'), `from js ${RUN}\n`)
  const template = Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .copy('note.txt', '/opt/js/note.txt', { mode: 0o640 })
    .setEnvs({ JS_BUILD: 'yes' })
    .setWorkdir('/opt/js')
    .runCmd('echo "$JS_BUILD" > env.txt', { user: 'root' })
    .setStartCmd("sh -c 'touch /tmp/js-started; sleep 100000'", waitForFile('/tmp/js-started'))
  const logs = []
  const info = await Template.build(template, 'e2e-js-build', {
    cpuCount: 1,
    memoryMB: 256,
    onBuildLogs: (e) => logs.push(e.message),
  })
  assert.equal(info.templateId, 'e2e-js-build')
  assert.ok(logs.some((m) => m.includes('template e2e-js-build ready')), logs.join('\n'))
  assert.equal(await Template.exists('e2e-js-build'), true)

  const sbx = await Sandbox.create('e2e-js-build', { metadata: tagged() })
  try {
    const run = async (cmd) => (await sbx.commands.run(cmd, { user: 'root' })).stdout.trim()
    assert.equal(await run('cat /opt/js/note.txt'), `from js ${RUN}`)
    assert.equal(await run("stat -c '%U %a' /opt/js/note.txt"), 'user 640')
    assert.equal(await run('cat /opt/js/env.txt'), 'yes')
    assert.equal((await sbx.commands.run('echo $JS_BUILD; pwd')).stdout.trim(), 'yes\n/opt/js')
    assert.equal(await run('test -e /tmp/js-started && echo ok'), 'ok')
  } finally {
    await sbx.kill()
  }
})
