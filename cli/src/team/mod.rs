//! What `shelfsync consumer add` creates for a consumer team, as text: the
//! team's NATS user (permissions and the config entries of nats.conf and of
//! the Helm values), and the files a team deploys with (compose and
//! kustomize). Pure: the verb (`cmd::consumer`) reads and writes the files.
//!
//! **One user per team in the SHELFSYNC account**, whose rights name the
//! team's consumers one by one: `<team>` (a durable the replicas share, for
//! stateless workers) and `<team>-0` … `<team>-<replicas-1>` (one per
//! replica, for services that hold the whole state in every replica, as
//! the picks template does). NATS matches permissions by whole subject
//! tokens and a consumer name is one token, so "names starting with the
//! team" cannot be written; an exact list can. An account per team would
//! isolate consumers by construction, but a consumer lives in the
//! stream's account: the team would have to source the change stream into
//! its own account (a full copy of seven days of changes per team) or be
//! granted the JetStream API of shelfsync's account through exports, which
//! again name consumers one by one.
//!
//! The password reaches nats-server as a bcrypt hash written in the config
//! (no environment variable, so no restart: a config reload picks the user
//! up); its plain form goes only to the team's `nats.env`, which git
//! ignores.

use shelfsync_bus::Subjects;

pub mod manifests;

/// The line that opens the teams' region in nats.conf and the Helm values.
pub const BEGIN: &str = "# BEGIN consumer teams (shelfsync consumer add; do not edit by hand)";
/// The line that closes it.
pub const END: &str = "# END consumer teams";
/// The comment that opens one team's entry: `# team <name>: …`.
const TEAM_TAG: &str = "# team ";

/// Names a team may not take: the services' and operators' users.
const RESERVED: &[&str] =
    &["admin", "ingest", "storage", "validator", "aggregator", "recommender", "sys", "shelfsync"];

/// A consumer team: its name, how many replicas may each hold a consumer
/// of their own, and whether it may publish commands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Team {
    pub name: String,
    pub replicas: u32,
    pub may_publish_commands: bool,
}

impl Team {
    /// Checks the name: 2–24 lower-case letters and digits, starting with a
    /// letter (no `-`: `<team>-<n>` must belong to one team only), not a
    /// service's user; 1–64 replicas.
    pub fn new(name: &str, replicas: u32, may_publish_commands: bool) -> Result<Team, String> {
        let valid = (2..=24).contains(&name.len())
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if !valid {
            return Err(format!(
                "team name {name:?}: 2 to 24 lower-case letters and digits, starting with a letter"
            ));
        }
        if RESERVED.contains(&name) {
            return Err(format!("team name {name:?} is a shelfsync service's user"));
        }
        if !(1..=64).contains(&replicas) {
            return Err(format!("--replicas {replicas}: between 1 and 64"));
        }
        Ok(Team { name: name.into(), replicas, may_publish_commands })
    }

    /// The consumer names the team may use: `<team>`, then `<team>-<n>`.
    pub fn consumer_names(&self) -> Vec<String> {
        std::iter::once(self.name.clone())
            .chain((0..self.replicas).map(|i| format!("{}-{i}", self.name)))
            .collect()
    }

    /// Where the team's replies arrive (the kits' `inbox_prefix`).
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX_{}", self.name)
    }

    /// The subjects the team's user may publish to, and subscribe to.
    pub fn permissions(&self, subjects: &Subjects) -> (Vec<String>, Vec<String>) {
        let (changes, keyframes) = (subjects.changes_stream(), subjects.keyframes_stream());
        let mut publish = vec![
            "$JS.API.INFO".to_string(),
            format!("$JS.API.STREAM.INFO.{changes}"),
            format!("$JS.API.STREAM.INFO.{keyframes}"),
        ];
        for name in self.consumer_names() {
            publish.extend([
                format!("$JS.API.CONSUMER.INFO.{changes}.{name}"),
                format!("$JS.API.CONSUMER.CREATE.{changes}.{name}"),
                format!("$JS.API.CONSUMER.CREATE.{changes}.{name}.>"),
                format!("$JS.API.CONSUMER.DURABLE.CREATE.{changes}.{name}"),
                format!("$JS.API.CONSUMER.DELETE.{changes}.{name}"),
                format!("$JS.API.CONSUMER.MSG.NEXT.{changes}.{name}"),
                format!("$JS.ACK.{changes}.{name}.>"),
            ]);
        }
        publish.extend([
            format!("$JS.API.DIRECT.GET.{keyframes}"),
            format!("$JS.API.DIRECT.GET.{keyframes}.>"),
            format!("$JS.API.STREAM.MSG.GET.{changes}"),
            subjects.ctl_keyframe(),
        ]);
        if self.may_publish_commands {
            publish.push(format!("{}.cmd.*", subjects.prefix()));
        }
        (publish, vec![format!("{}.>", self.inbox_prefix())])
    }

    /// The comment that opens the team's entry (and that `list` reads back).
    fn tag(&self) -> String {
        format!(
            "{TEAM_TAG}{}: consumers {}, {}-0..{}-{}; commands: {}",
            self.name,
            self.name,
            self.name,
            self.name,
            self.replicas - 1,
            if self.may_publish_commands { "yes" } else { "no" }
        )
    }

    /// The entry of the `users` list of nats.conf's SHELFSYNC account.
    pub fn nats_conf_entry(
        &self,
        subjects: &Subjects,
        password_hash: &str,
        indent: &str,
    ) -> String {
        let (publish, subscribe) = self.permissions(subjects);
        let list = |subjects: &[String]| {
            subjects.iter().map(|s| format!("{indent}      \"{s}\"")).collect::<Vec<_>>().join("\n")
        };
        format!(
            "{indent}{tag}\n{indent}{{\n{indent}  user: {name}\n{indent}  password: \"{password_hash}\"\n\
             {indent}  permissions: {{\n{indent}    publish: {{ allow: [\n{publish}\n{indent}    ] }}\n\
             {indent}    subscribe: {{ allow: [\n{subscribe}\n{indent}    ] }}\n{indent}  }}\n{indent}}}\n",
            tag = self.tag(),
            name = self.name,
            publish = list(&publish),
            subscribe = list(&subscribe),
        )
    }

    /// The entry of the `users` list of the Helm values' SHELFSYNC account.
    pub fn helm_values_entry(
        &self,
        subjects: &Subjects,
        password_hash: &str,
        indent: &str,
    ) -> String {
        let (publish, subscribe) = self.permissions(subjects);
        let list = |subjects: &[String]| {
            subjects.iter().map(|s| format!("{indent}        - \"{s}\"\n")).collect::<String>()
        };
        format!(
            "{indent}{tag}\n{indent}- user: {name}\n{indent}  password: \"{password_hash}\"\n\
             {indent}  permissions:\n{indent}    publish:\n{indent}      allow:\n{publish}\
             {indent}    subscribe:\n{indent}      allow:\n{subscribe}",
            tag = self.tag(),
            name = self.name,
            publish = list(&publish),
            subscribe = list(&subscribe),
        )
    }
}

/// The region between [`BEGIN`] and [`END`] of a config file: the byte
/// range of its body (after BEGIN's line, up to END's line) and the
/// indentation of the BEGIN line.
fn region(text: &str) -> Result<(usize, usize, String), String> {
    let begin = text.find(BEGIN).ok_or("no teams region (its BEGIN line is missing)")?;
    let line_start = text[..begin].rfind('\n').map_or(0, |i| i + 1);
    let indent = text[line_start..begin].to_string();
    let body = begin + text[begin..].find('\n').ok_or("nothing after the BEGIN line")? + 1;
    let end = body + text[body..].find(END).ok_or("the teams region has no END line")?;
    let end_line = text[..end].rfind('\n').map_or(0, |i| i + 1);
    Ok((body, end_line, indent))
}

/// The teams a config file's region holds, as their entries' comments
/// record them.
pub fn list(text: &str) -> Result<Vec<Team>, String> {
    let (body, end, _) = region(text)?;
    let mut teams = Vec::new();
    for line in text[body..end].lines() {
        let Some(rest) = line.trim_start().strip_prefix(TEAM_TAG) else { continue };
        let (name, rest) = rest.split_once(':').ok_or_else(|| format!("bad team line: {line}"))?;
        let replicas = rest
            .split(&format!("{name}-0..{name}-"))
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|n| n.trim().parse::<u32>().ok())
            .ok_or_else(|| format!("bad team line: {line}"))?
            + 1;
        let may_publish_commands = rest.trim_end().ends_with("commands: yes");
        teams.push(Team { name: name.to_string(), replicas, may_publish_commands });
    }
    Ok(teams)
}

/// `text` without `team`'s entry (from its tag line up to the next tag or
/// the end of the region); `None` when it has no such entry.
pub fn remove(text: &str, team: &str) -> Result<Option<String>, String> {
    let (body, end, _) = region(text)?;
    let region = &text[body..end];
    let tag = format!("{TEAM_TAG}{team}:");
    let mut offset = 0;
    let (mut start, mut stop) = (None, None);
    for line in region.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with(TEAM_TAG) {
            if start.is_some() && stop.is_none() {
                stop = Some(offset);
            }
            if trimmed.starts_with(&tag) {
                start = Some(offset);
            }
        }
        offset += line.len();
    }
    let Some(start) = start else { return Ok(None) };
    let stop = stop.unwrap_or(region.len());
    Ok(Some(format!("{}{}", &text[..body + start], &text[body + stop..])))
}

/// `text` with `entry` (rendered with the region's indentation by
/// `render`) added at the end of the region, replacing the team's entry if
/// there is one.
pub fn insert(
    text: &str,
    team: &str,
    render: impl FnOnce(&str) -> String,
) -> Result<String, String> {
    let text = remove(text, team)?.unwrap_or_else(|| text.to_string());
    let (_, end, indent) = region(&text)?;
    Ok(format!("{}{}{}", &text[..end], render(&indent), &text[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = "users: [\n  { user: admin }\n  # BEGIN consumer teams (shelfsync consumer add; do not edit by hand)\n  # END consumer teams\n]\n";

    #[test]
    fn names_are_checked() {
        assert!(Team::new("alpha", 2, false).is_ok());
        for bad in ["a", "Alpha", "al-pha", "1abc", "validator", &"x".repeat(25)] {
            assert!(Team::new(bad, 2, false).is_err(), "{bad}");
        }
        assert!(Team::new("alpha", 0, false).is_err());
    }

    #[test]
    fn permissions_name_the_teams_consumers_only() {
        let team = Team::new("alpha", 2, false).unwrap();
        assert_eq!(team.consumer_names(), ["alpha", "alpha-0", "alpha-1"]);
        let (publish, subscribe) = team.permissions(&Subjects::new("shelfsync"));
        assert_eq!(subscribe, ["_INBOX_alpha.>"]);
        assert!(publish.contains(&"$JS.ACK.SHELFSYNC_CHANGES.alpha-1.>".to_string()));
        assert!(publish.iter().all(|s| !s.contains('*') && !s.contains("cmd")), "{publish:?}");
        // Every consumer-level subject names one of the team's consumers.
        for s in publish.iter().filter(|s| s.contains("CONSUMER") || s.starts_with("$JS.ACK")) {
            let tokens: Vec<&str> = s.split('.').collect();
            let stream = tokens.iter().position(|t| *t == "SHELFSYNC_CHANGES").unwrap();
            let name = tokens[stream + 1];
            assert!(team.consumer_names().iter().any(|n| n == name), "{s}");
        }
        let commands = Team::new("beta", 1, true).unwrap().permissions(&Subjects::new("x")).0;
        assert!(commands.contains(&"x.cmd.*".to_string()));
    }

    #[test]
    fn entries_go_in_come_back_and_go_out() {
        let s = Subjects::new("shelfsync");
        let alpha = Team::new("alpha", 2, false).unwrap();
        let beta = Team::new("beta", 4, true).unwrap();
        let text = insert(CONF, "alpha", |i| alpha.nats_conf_entry(&s, "$2b$hash", i)).unwrap();
        let text = insert(&text, "beta", |i| beta.nats_conf_entry(&s, "$2b$hash", i)).unwrap();
        let listed = list(&text).unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].name.as_str(), listed[0].replicas), ("alpha", 2));
        assert!(!listed[0].may_publish_commands && listed[1].may_publish_commands);
        assert_eq!(listed[1].replicas, 4);
        // Adding again replaces.
        let again = insert(&text, "alpha", |i| alpha.nats_conf_entry(&s, "$2b$other", i)).unwrap();
        assert_eq!(list(&again).unwrap().len(), 2);
        assert_eq!((again.matches("$2b$other").count(), again.matches("$2b$hash").count()), (1, 1));
        let without = remove(&again, "alpha").unwrap().unwrap();
        assert_eq!(list(&without).unwrap().len(), 1);
        let empty = remove(&without, "beta").unwrap().unwrap();
        assert_eq!(empty, CONF);
        assert_eq!(remove(&empty, "beta").unwrap(), None);
        assert!(list("no region").is_err());
    }
}
