// Shared helpers for the agent's JS end-to-end tests (node --test).
// The agent listens on 127.0.0.1:49983; E2B_DEBUG=true makes the SDK use it.
process.env.E2B_DEBUG ??= 'true'
process.env.E2B_API_KEY ??= 'tine-e2e'

export const AGENT = 'http://127.0.0.1:49983'

export function envelope(obj, flags = 0) {
  const payload = Buffer.from(JSON.stringify(obj))
  const head = Buffer.alloc(5)
  head[0] = flags
  head.writeUInt32BE(payload.length, 1)
  return Buffer.concat([head, payload])
}

export function frames(buf) {
  const out = []
  let i = 0
  while (i + 5 <= buf.length) {
    const n = buf.readUInt32BE(i + 1)
    out.push([buf[i], JSON.parse(buf.subarray(i + 5, i + 5 + n).toString() || '{}')])
    i += 5 + n
  }
  if (i !== buf.length) throw new Error('trailing bytes after the last frame')
  return out
}

export function tmpName(prefix) {
  return `/tmp/tine-e2e-js-${prefix}-${Math.random().toString(16).slice(2, 10)}`
}
