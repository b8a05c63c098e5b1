//! The `events` table: what happened to each sandbox, in order.

use rusqlite::params;

use super::{now_ms, Db, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub at_ms: i64,
    pub kind: String,
    pub detail: String,
}

impl Db {
    pub fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()> {
        self.conn().execute(
            "INSERT INTO events (sandbox_id, at_ms, kind, detail) VALUES (?1, ?2, ?3, ?4)",
            params![sandbox_id, now_ms(), kind, detail],
        )?;
        Ok(())
    }

    pub fn events(&self, sandbox_id: &str) -> Result<Vec<Event>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT at_ms, kind, detail FROM events WHERE sandbox_id = ?1 ORDER BY seq")?;
        let rows = stmt.query_map([sandbox_id], |r| {
            Ok(Event {
                at_ms: r.get(0)?,
                kind: r.get(1)?,
                detail: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
