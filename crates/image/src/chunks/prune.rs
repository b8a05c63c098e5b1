//! Removing artifacts from a registry: the manifests of some tags of a
//! repository, and the chunks (blobs) that no other tag of it names.
//!
//! The OCI distribution API deletes a manifest by digest (every tag on it
//! goes with it) and unlinks a blob from one repository; the registry's
//! own garbage collection frees the storage of blobs no repository links.
//! `oci-client` has no delete, so the two DELETEs go out with `reqwest`
//! (the client `oci-client` itself is built on), anonymous or with the
//! registry's basic credentials; a registry that wants a bearer token for
//! deletes answers 401 and the removal is reported as failed.
//!
//! Safe against a push racing it: a blob the push found in the registry and
//! did not send again, then removed here, makes the registry refuse that
//! push's manifest (blob unknown), and the push is tried again, sending it.

use std::collections::HashSet;

use oci_client::Reference;

use crate::reference::{is_loopback, ImageRef};
use crate::registry::{auth, client, RegistryOptions};
use crate::{ImageError, Result};

/// What [`remove_tags`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removed {
    pub manifests: usize,
    pub blobs: usize,
    /// Blobs of the removed tags that another tag still names.
    pub kept: usize,
}

/// Remove tags `tags` of `repo`'s repository (the tag of `repo` itself
/// does not matter): their manifests, unless another tag is on the same
/// manifest, and their blobs that no other tag's manifest names. Tags
/// that are not there are skipped.
pub async fn remove_tags(
    repo: &ImageRef,
    tags: &[String],
    opts: &RegistryOptions,
) -> Result<Removed> {
    let fail = |detail: String| ImageError::Registry {
        reference: repo.to_string(),
        detail,
    };
    let oci = client(repo, opts);
    let creds = auth(repo, opts, None);
    let at = |tag: &str| {
        Reference::with_tag(
            repo.oci().registry().to_string(),
            repo.oci().repository().to_string(),
            tag.to_string(),
        )
    };
    let mut all = Vec::new();
    let mut last: Option<String> = None;
    loop {
        let page = oci
            .list_tags(&at("latest"), &creds, Some(1000), last.as_deref())
            .await
            .map_err(|e| fail(format!("listing tags: {e}")))?;
        let n = page.tags.len();
        last = page.tags.last().cloned();
        all.extend(page.tags);
        if n < 1000 {
            break;
        }
    }
    let gone: HashSet<&str> = tags.iter().map(String::as_str).collect();
    let (mut keep_blobs, mut keep_manifests) = (HashSet::new(), HashSet::new());
    let mut drop = Vec::new();
    for tag in &all {
        let (manifest, digest) = oci
            .pull_image_manifest(&at(tag), &creds)
            .await
            .map_err(|e| fail(format!("reading the manifest of {tag}: {e}")))?;
        let blobs: Vec<String> = std::iter::once(manifest.config.digest.clone())
            .chain(manifest.layers.iter().map(|l| l.digest.clone()))
            .collect();
        if gone.contains(tag.as_str()) {
            drop.push((digest, blobs));
        } else {
            keep_blobs.extend(blobs);
            keep_manifests.insert(digest);
        }
    }
    let base = format!(
        "{}://{}/v2/{}",
        scheme(repo, opts),
        repo.resolved_registry(),
        repo.oci().repository()
    );
    crate::registry::install_crypto_provider();
    let http = reqwest::Client::new();
    let basic = opts.credentials.get(repo.registry()).cloned();
    // Ok(true): deleted; Ok(false): it was not there.
    let delete = |what: String| {
        let mut req = http.delete(format!("{base}/{what}"));
        if let Some(c) = &basic {
            req = req.basic_auth(&c.username, Some(&c.password));
        }
        async move {
            let r = req
                .send()
                .await
                .map_err(|e| format!("deleting {what}: {e}"))?;
            match r.status().as_u16() {
                200..=299 => Ok(true),
                404 => Ok(false),
                s => Err(format!("deleting {what}: HTTP {s}")),
            }
        }
    };
    let mut removed = Removed::default();
    let mut blobs_done = HashSet::new();
    for (digest, blobs) in drop {
        if !keep_manifests.contains(&digest)
            && delete(format!("manifests/{digest}")).await.map_err(&fail)?
        {
            removed.manifests += 1;
        }
        for b in blobs {
            if keep_blobs.contains(&b) {
                removed.kept += 1;
            } else if blobs_done.insert(b.clone())
                && delete(format!("blobs/{b}")).await.map_err(&fail)?
            {
                removed.blobs += 1;
            }
        }
    }
    Ok(removed)
}

/// `http` for registries spoken to over plain HTTP (as [`client`] does).
fn scheme(repo: &ImageRef, opts: &RegistryOptions) -> &'static str {
    let plain = [repo.registry(), repo.resolved_registry()]
        .iter()
        .any(|r| is_loopback(r) || opts.insecure.iter().any(|i| i == r));
    if plain {
        "http"
    } else {
        "https"
    }
}
