//! The files a team deploys with, as `shelfsync consumer add` writes them:
//! `compose/teams/<team>/` (a compose file to run next to shelfsync's) and
//! `k8s/teams/<team>/` (a kustomization: the Secret from `nats.env`, the
//! NetworkPolicies, a StatefulSet skeleton). Both read the credentials from
//! `nats.env` in their folder, which a `.gitignore` there keeps out of git.

use super::Team;

/// One file to write: its path below the output directory, its text, and
/// whether it holds a secret (written with mode 0600).
pub struct File {
    pub path: String,
    pub text: String,
    pub secret: bool,
}

/// Every file of `team`, its password in the two `nats.env`.
pub fn files(team: &Team, password: &str, namespace: &str) -> Vec<File> {
    let t = &team.name;
    let env = nats_env(team, password);
    let file = |path: String, text: String| File { path, text, secret: false };
    vec![
        file(format!("compose/teams/{t}/compose.yaml"), compose(team)),
        File { path: format!("compose/teams/{t}/nats.env"), text: env.clone(), secret: true },
        file(format!("compose/teams/{t}/.gitignore"), "nats.env\n".into()),
        file(format!("k8s/teams/{t}/kustomization.yaml"), kustomization(team, namespace)),
        file(format!("k8s/teams/{t}/networkpolicy.yaml"), network_policies(team)),
        file(format!("k8s/teams/{t}/statefulset.yaml"), statefulset(team)),
        File { path: format!("k8s/teams/{t}/nats.env"), text: env, secret: true },
        file(format!("k8s/teams/{t}/.gitignore"), "nats.env\n".into()),
    ]
}

/// The team's NATS credentials as the settings' environment variables
/// (the Rust kit reads them as they are; map them for another language).
fn nats_env(team: &Team, password: &str) -> String {
    format!(
        "# NATS credentials of the consumer team {t} (shelfsync consumer add). Keep out of git.\n\
         SHELFSYNC__NATS__USER={t}\nSHELFSYNC__NATS__PASSWORD={password}\n\
         SHELFSYNC__NATS__INBOX_PREFIX={inbox}\n",
        t = team.name,
        inbox = team.inbox_prefix(),
    )
}

fn compose(team: &Team) -> String {
    let t = &team.name;
    let mut out = format!(
        "# The consumer team {t} next to shelfsync's stack (shelfsync consumer add {t}):\n\
         #   docker compose -f compose/compose.yaml -f compose/teams/{t}/compose.yaml up -d\n\
         # Paths are relative to compose/ (the first file's folder). Credentials: nats.env here.\n\
         # One service per replica: replica <n> reads through the consumer {t}-<n>\n\
         # (SHELFSYNC_REPLICA); replace the image with your service's.\n\
         services:\n"
    );
    for i in 0..team.replicas {
        out.push_str(&format!(
            "  {t}-{i}:\n    image: registry.example.com/{t}/{t}:0.1.0\n\
             \x20   env_file: [teams/{t}/nats.env]\n    environment:\n\
             \x20     SHELFSYNC__NATS__URL: nats://nats:4222\n      SHELFSYNC_REPLICA: \"{i}\"\n\
             \x20   depends_on:\n      nats: {{condition: service_healthy}}\n\
             \x20   restart: unless-stopped\n"
        ));
    }
    out
}

fn kustomization(team: &Team, namespace: &str) -> String {
    let t = &team.name;
    format!(
        "# The consumer team {t} (shelfsync consumer add {t} --replicas {r}): its NATS credentials\n\
         # as the Secret {t}-nats (from nats.env, which git ignores), the NetworkPolicies that let\n\
         # its pods reach NATS, and a StatefulSet skeleton to fill in.\n\
         #   kubectl apply -k k8s/teams/{t}\n\
         apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\n\
         namespace: {namespace}\n\nresources:\n  - networkpolicy.yaml\n  - statefulset.yaml\n\n\
         secretGenerator:\n  - name: {t}-nats\n    envs: [nats.env]\n",
        r = team.replicas,
    )
}

fn network_policies(team: &Team) -> String {
    let t = &team.name;
    format!(
        "# The namespace denies all traffic by default (k8s/base/networkpolicies.yaml): the team's\n\
         # pods (label shelfsync.io/team: {t}) may reach NATS, NATS admits them, and Prometheus\n\
         # (namespace monitoring) may scrape them.\n\
         apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: team-{t}-to-nats\n\
         spec:\n  podSelector:\n    matchLabels: {{shelfsync.io/team: {t}}}\n  policyTypes: [Egress]\n\
         \x20 egress:\n    - to:\n        - podSelector:\n\
         \x20           matchLabels: {{app.kubernetes.io/name: nats, app.kubernetes.io/instance: nats}}\n\
         \x20     ports:\n        - {{protocol: TCP, port: 4222}}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: nats-from-team-{t}\n\
         spec:\n  podSelector:\n\
         \x20   matchLabels: {{app.kubernetes.io/name: nats, app.kubernetes.io/instance: nats}}\n\
         \x20 policyTypes: [Ingress]\n  ingress:\n    - from:\n        - podSelector:\n\
         \x20           matchLabels: {{shelfsync.io/team: {t}}}\n\
         \x20     ports:\n        - {{protocol: TCP, port: 4222}}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: team-{t}-metrics\n\
         spec:\n  podSelector:\n    matchLabels: {{shelfsync.io/team: {t}}}\n  policyTypes: [Ingress]\n\
         \x20 ingress:\n    - from:\n        - namespaceSelector:\n\
         \x20           matchLabels: {{kubernetes.io/metadata.name: monitoring}}\n\
         \x20     ports:\n        - {{protocol: TCP, port: 8080}}\n"
    )
}

fn statefulset(team: &Team) -> String {
    let t = &team.name;
    format!(
        "# A skeleton: replace the image (and add a command, settings, volumes) with your service's.\n\
         # Replica <n> reads through the consumer {t}-<n>: SHELFSYNC_REPLICA is the pod's ordinal,\n\
         # stable across restarts, and a StatefulSet never runs two pods of one ordinal at once\n\
         # (a Deployment's rollout would). For stateless workers that share the changes between\n\
         # them, use the shared durable {t} and a Deployment instead (docs/SUBSCRIBING.md).\n\
         apiVersion: v1\nkind: Service\nmetadata:\n  name: {t}\n  labels: {{shelfsync.io/team: {t}}}\n\
         spec:\n  clusterIP: None\n  selector: {{app.kubernetes.io/name: {t}}}\n\
         \x20 ports:\n    - {{name: http, port: 8080, targetPort: http}}\n---\n\
         apiVersion: apps/v1\nkind: StatefulSet\nmetadata:\n  name: {t}\n\
         \x20 labels: {{app.kubernetes.io/name: {t}, shelfsync.io/team: {t}}}\nspec:\n\
         \x20 serviceName: {t}\n  replicas: {r}\n  podManagementPolicy: Parallel\n\
         \x20 selector:\n    matchLabels: {{app.kubernetes.io/name: {t}}}\n  template:\n\
         \x20   metadata:\n      labels: {{app.kubernetes.io/name: {t}, shelfsync.io/team: {t}}}\n\
         \x20   spec:\n      automountServiceAccountToken: false\n      securityContext:\n\
         \x20       runAsNonRoot: true\n        runAsUser: 10001\n        runAsGroup: 10001\n\
         \x20       seccompProfile: {{type: RuntimeDefault}}\n      containers:\n\
         \x20       - name: {t}\n          image: registry.example.com/{t}/{t}:0.1.0\n\
         \x20         env:\n            - name: SHELFSYNC_REPLICA\n\
         \x20             valueFrom:\n\
         \x20               fieldRef: {{fieldPath: \"metadata.labels['apps.kubernetes.io/pod-index']\"}}\n\
         \x20           - {{name: SHELFSYNC__NATS__URL, value: \"nats://nats:4222\"}}\n\
         \x20         envFrom:\n            - secretRef: {{name: {t}-nats}}\n\
         \x20         ports:\n            - {{name: http, containerPort: 8080}}\n\
         \x20         readinessProbe:\n            httpGet: {{path: /readyz, port: http}}\n\
         \x20         livenessProbe:\n            httpGet: {{path: /healthz, port: http}}\n\
         \x20         resources:\n            requests: {{cpu: 100m, memory: 128Mi}}\n\
         \x20           limits: {{memory: 512Mi}}\n          securityContext:\n\
         \x20           allowPrivilegeEscalation: false\n            readOnlyRootFilesystem: true\n\
         \x20           runAsNonRoot: true\n            capabilities: {{drop: [ALL]}}\n",
        r = team.replicas,
    )
}
