// Shared helpers for the server's JS end-to-end tests (node --test).
// run.sh sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY to the test
// server; every sandbox gets this run's tag in its metadata.
import { Sandbox } from 'e2b'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_VOLUME_API_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} is not set: run tests/e2e/server/run.sh`)
}

export const RUN = Math.random().toString(16).slice(2, 14)

export function tagged(metadata = {}) {
  return { 'tine-e2e-js': RUN, ...metadata }
}

export async function newSandbox(opts = {}) {
  return Sandbox.create({ ...opts, metadata: tagged(opts.metadata) })
}

export async function listAll(opts) {
  const p = Sandbox.list(opts)
  const items = []
  const pages = []
  while (p.hasNext) {
    const page = await p.nextItems()
    pages.push(page.length)
    items.push(...page)
  }
  return { items, pages }
}
