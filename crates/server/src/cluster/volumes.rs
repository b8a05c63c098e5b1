//! Where each volume of a cluster lives: a volume's files are on the node
//! that made it (`tine_volumes`), and gateways send its calls there.

use super::catalog::{Catalog, Result, NOW_MS};

/// A volume as the catalog knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePlace {
    pub id: String,
    pub team: String,
    pub name: String,
    pub node: String,
}

fn place(r: &tokio_postgres::Row) -> VolumePlace {
    VolumePlace {
        id: r.get(0),
        team: r.get(1),
        name: r.get(2),
        node: r.get(3),
    }
}

impl Catalog {
    /// Record volume `v`; false when its team has one of that name already.
    pub async fn add_volume(&self, v: &VolumePlace) -> Result<bool> {
        let db = self.pool.get().await?;
        let n = db
            .execute(
                &format!(
                    "INSERT INTO tine_volumes (id, team, name, node_id, created_ms)
                     VALUES ($1, $2, $3, $4, {NOW_MS}) ON CONFLICT DO NOTHING"
                ),
                &[&v.id, &v.team, &v.name, &v.node],
            )
            .await?;
        Ok(n == 1)
    }

    /// Volume `id_or_name` of `team`.
    pub async fn volume(&self, team: &str, id_or_name: &str) -> Result<Option<VolumePlace>> {
        let db = self.pool.get().await?;
        let row = db
            .query_opt(
                "SELECT id, team, name, node_id FROM tine_volumes
                 WHERE team = $1 AND (id = $2 OR name = $2) ORDER BY id = $2 DESC LIMIT 1",
                &[&team, &id_or_name],
            )
            .await?;
        Ok(row.as_ref().map(place))
    }

    /// Volume `id` of any team (a content call names it with its token).
    pub async fn volume_by_id(&self, id: &str) -> Result<Option<VolumePlace>> {
        let db = self.pool.get().await?;
        let row = db
            .query_opt(
                "SELECT id, team, name, node_id FROM tine_volumes WHERE id = $1",
                &[&id],
            )
            .await?;
        Ok(row.as_ref().map(place))
    }

    /// `team`'s volumes, oldest first.
    pub async fn volumes(&self, team: &str) -> Result<Vec<VolumePlace>> {
        let db = self.pool.get().await?;
        let rows = db
            .query(
                "SELECT id, team, name, node_id FROM tine_volumes WHERE team = $1
                 ORDER BY created_ms, id",
                &[&team],
            )
            .await?;
        Ok(rows.iter().map(place).collect())
    }

    pub async fn remove_volume(&self, id: &str) -> Result<()> {
        let db = self.pool.get().await?;
        db.execute("DELETE FROM tine_volumes WHERE id = $1", &[&id])
            .await?;
        Ok(())
    }
}
