//! The `image_access` table: which teams have shown a registry they may
//! pull an image (by manifest digest). A build falls back to the local copy
//! of an image (when its registry cannot be reached) only for a team
//! listed here, or for any team when the image was pulled without
//! credentials (team `*`): a copy pulled with one team's credentials is
//! never another team's.

use rusqlite::params;

use super::{Db, Result};

/// The `team` of an image pulled without credentials: public.
pub const ANY_TEAM: &str = "*";

impl Db {
    /// Record that `team` (or [`ANY_TEAM`]) pulled the image `digest`.
    pub fn grant_image(&self, digest: &str, team: &str) -> Result<()> {
        self.conn().execute(
            "INSERT OR IGNORE INTO image_access (digest, team) VALUES (?1, ?2)",
            params![digest, team],
        )?;
        Ok(())
    }

    /// Whether `team` may use the local copy of image `digest`.
    pub fn image_granted(&self, digest: &str, team: &str) -> Result<bool> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM image_access WHERE digest = ?1 AND team IN (?2, ?3)",
            params![digest, team, ANY_TEAM],
            |r| r.get(0),
        )?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_the_pulling_teams_or_everyones() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        assert!(!db.image_granted("sha256:a", "red").unwrap());
        db.grant_image("sha256:a", "red").unwrap();
        db.grant_image("sha256:a", "red").unwrap();
        assert!(db.image_granted("sha256:a", "red").unwrap());
        assert!(!db.image_granted("sha256:a", "blue").unwrap());
        db.grant_image("sha256:b", ANY_TEAM).unwrap();
        assert!(db.image_granted("sha256:b", "blue").unwrap());
    }
}
