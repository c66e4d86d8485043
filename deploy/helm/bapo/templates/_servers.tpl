{{/*
The optional gRPC servers of your own image that the actors call: the
reward server (component and values key "reward", bapo.v1.RewardService)
and the environment server ("env", bapo.v1.EnvironmentService). Both are
rendered by the same templates here: (dict "root" $ "component" c
"portEnv" "BAPO_<C>_PORT" "what" "<one comment line>" "metrics" "<the
actors' metrics that say how it does>"); .Values.<component> holds the
values (image, command, args, port, listenArg, tlsArgs, clientAuthArgs,
sandbox, dnsEgress, replicas, ...).
*/}}

{{/*
The pod and container security contexts of such a server: the chart's (or
the component's own, when set); with <component>.sandbox.enabled, the
chart's but root with only CAP_SETUID and CAP_SETGID, which the reference
server keeps when --server-user drops it to its own uid (to start each
sandboxed program as a uid of its own). (dict "root" $ "v" values "which"
"pod"|"container").
*/}}
{{- define "bapo.userServer.securityContext" -}}
{{- $r := .root -}}
{{- $v := .v -}}
{{- $sandbox := and $v.sandbox $v.sandbox.enabled -}}
{{- if eq .which "pod" -}}
{{- if $v.podSecurityContext -}}
{{- toYaml $v.podSecurityContext -}}
{{- else if $sandbox -}}
{{- toYaml (merge (dict "runAsNonRoot" false "runAsUser" 0 "runAsGroup" 0) (omit $r.Values.podSecurityContext "runAsNonRoot" "runAsUser" "runAsGroup")) -}}
{{- else -}}
{{- toYaml $r.Values.podSecurityContext -}}
{{- end -}}
{{- else -}}
{{- if $v.containerSecurityContext -}}
{{- toYaml $v.containerSecurityContext -}}
{{- else if $sandbox -}}
{{- toYaml (merge (dict "runAsNonRoot" false "runAsUser" 0 "capabilities" (dict "drop" (list "ALL") "add" (list "SETUID" "SETGID"))) (omit $r.Values.containerSecurityContext "runAsNonRoot" "runAsUser" "capabilities")) -}}
{{- else -}}
{{- toYaml $r.Values.containerSecurityContext -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Deployment of such a server. */}}
{{- define "bapo.userServer.deployment" -}}
{{- $r := .root -}}
{{- $comp := .component -}}
{{- $c := dict "root" $r "component" $comp -}}
{{- $v := index $r.Values $comp -}}
{{- $tls := and $r.Values.tls.enabled (not $r.Values.insecure) -}}
{{- $dir := include "bapo.tls.dir" $r -}}
{{- $psc := include "bapo.userServer.securityContext" (dict "root" $r "v" $v "which" "pod") | fromYaml -}}
{{- $csc := include "bapo.userServer.securityContext" (dict "root" $r "v" $v "which" "container") | fromYaml -}}
{{- $sandbox := and $v.sandbox $v.sandbox.enabled -}}
{{- $clientCa := and $tls $v.clientAuthArgs -}}
{{- $args := default list $v.args -}}
{{- if $v.listenArg -}}
{{- $args = concat $args (list "--listen" (printf "0.0.0.0:%d" (int $v.port))) -}}
{{- end -}}
{{- if and $tls $v.tlsArgs -}}
{{- $args = concat $args (list "--tls-cert" (printf "%s/tls.crt" $dir) "--tls-key" (printf "%s/tls.key" $dir)) -}}
{{- end -}}
{{- if $v.clientAuthArgs -}}
{{- if $tls -}}
{{- $args = concat $args (list "--client-ca" (include "bapo.tls.caFile" $r)) -}}
{{- else -}}
{{- /* insecure: the NetworkPolicy is the only fence, as for bapo's own services */ -}}
{{- $args = concat $args (list "--allow-unauthenticated") -}}
{{- end -}}
{{- end -}}
{{- if $sandbox -}}
{{- $args = concat $args (list "--server-user" (printf "%d:%d" (int $v.sandbox.serverUser) (int $v.sandbox.serverGroup))) -}}
{{- end -}}
# {{ .what | wrapWith 74 "\n# " }}
# Under mutual TLS it serves TLS: its certificate is mounted at {{ $dir }},
# the actors verify it with their CA{{ if $clientCa }}, and it verifies theirs
# (--client-ca: only certificates of this release's CA get in){{ end }}.
{{- if $sandbox }}
# Sandbox: the container starts as root with only CAP_SETUID and CAP_SETGID
# and the server drops to uid {{ $v.sandbox.serverUser }} keeping them
# (--server-user), to run each program as a uid of its own.
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "bapo.componentName" $c }}
  namespace: {{ $r.Release.Namespace }}
  labels:
    {{- include "bapo.labels" $c | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      # No GPUs here: start the new pod before the old one goes, so the
      # actors keep a server to call during a rollout.
      maxSurge: 25%
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "bapo.selectorLabels" $c | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "bapo.labels" $c | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "bapo.serviceAccountName" $r }}
      automountServiceAccountToken: {{ $r.Values.serviceAccount.automountToken }}
      {{- with $r.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $psc | nindent 8 }}
      containers:
        - name: {{ $comp }}
          image: {{ printf "%s:%s" (required (printf "%s.image.repository is required when %s.enabled is true" $comp $comp) $v.image.repository) (required (printf "%s.image.tag is required when %s.enabled is true" $comp $comp) $v.image.tag) | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          {{- with $v.command }}
          command:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $args }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          env:
            - name: HOME
              value: /tmp
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            # For an image that takes other flags (listenArg, tlsArgs off).
            - name: {{ .portEnv }}
              value: {{ $v.port | quote }}
            {{- if $tls }}
            - name: BAPO_TLS_CERT
              value: {{ printf "%s/tls.crt" $dir }}
            - name: BAPO_TLS_KEY
              value: {{ printf "%s/tls.key" $dir }}
            {{- end }}
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
          # TCP connects on the gRPC port: the reference server has no
          # grpc.health.v1 service, and under TLS kubelet's native gRPC
          # probe (plaintext) could not talk to it. Says the server listens,
          # not that it answers well; failed calls show in the actors'
          # {{ .metrics }} metrics.
          startupProbe:
            tcpSocket:
              port: grpc
            {{- toYaml $v.startupProbe | nindent 12 }}
          livenessProbe:
            tcpSocket:
              port: grpc
            {{- toYaml $v.livenessProbe | nindent 12 }}
          readinessProbe:
            tcpSocket:
              port: grpc
            {{- toYaml $v.readinessProbe | nindent 12 }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- toYaml $csc | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $tls }}
            # Mounted whole (no subPath), so renewed files reach the pod.
            - name: tls
              mountPath: {{ $dir }}
              readOnly: true
            {{- if and $clientCa $r.Values.tls.caBundle }}
            - name: tls-ca
              mountPath: {{ include "bapo.tls.caDir" $r }}
              readOnly: true
            {{- end }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $r.Values.tmpSizeLimit }}
        {{- if $tls }}
        - name: tls
          secret:
            secretName: {{ include "bapo.tls.secretName" $c }}
            # 0440 with fsGroup (the key readable by the pod's group only), else 0444.
            defaultMode: {{ ternary 288 292 (not (empty $psc.fsGroup)) }}
        {{- if and $clientCa $r.Values.tls.caBundle }}
        - name: tls-ca
          configMap:
            name: {{ include "bapo.fullname" $r }}-ca-bundle
        {{- end }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* Its ClusterIP Service: (dict "root" $ "component" c "url" "<the actors' endpoint>" "metrics" "..."). */}}
{{- define "bapo.userServer.service" -}}
{{- $r := .root -}}
{{- $c := dict "root" $r "component" .component -}}
{{- $v := index $r.Values .component -}}
# {{ printf "The address in the actors' %s." .url | wrapWith 74 "\n# " }}
# No metrics port and no bapo.io/scrape label: the server exports nothing
# the chart knows; the actors' {{ .metrics }} metrics say how it does.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "bapo.componentName" $c }}
  namespace: {{ $r.Release.Namespace }}
  labels:
    {{- include "bapo.labels" $c | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "bapo.selectorLabels" $c | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end -}}

{{/* Its PodDisruptionBudget: (dict "root" $ "component" c). */}}
{{- define "bapo.userServer.pdb" -}}
{{- $r := .root -}}
{{- $c := dict "root" $r "component" .component -}}
{{- $v := index $r.Values .component -}}
# Voluntary disruptions (node drains, upgrades) take these servers a few at
# a time, so the actors keep one to call.
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "bapo.componentName" $c }}
  namespace: {{ $r.Release.Namespace }}
  labels:
    {{- include "bapo.labels" $c | nindent 4 }}
spec:
  maxUnavailable: {{ $v.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "bapo.selectorLabels" $c | nindent 6 }}
{{- end -}}

{{/*
Its NetworkPolicy: in, only the pods of the client components (the actors;
for the environment server also the learner, whose evaluation plays
episodes), on the gRPC port (no metrics port, so nothing for Prometheus);
out (with restrictEgress), <component>.extraEgress and, with
<component>.dnsEgress, DNS (which sandboxed programs could use to carry
data out).
(dict "root" $ "component" c "clients" (list "actor" ...)).
*/}}
{{- define "bapo.userServer.networkPolicy" -}}
{{- $r := .root -}}
{{- $c := dict "root" $r "component" .component -}}
{{- $v := index $r.Values .component -}}
{{- $np := $r.Values.networkPolicy -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "bapo.componentName" $c }}
  namespace: {{ $r.Release.Namespace }}
  labels:
    {{- include "bapo.labels" $c | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "bapo.selectorLabels" $c | nindent 6 }}
  policyTypes:
    - Ingress
    {{- if $np.restrictEgress }}
    - Egress
    {{- end }}
  ingress:
    - from:
        {{- range $client := .clients }}
        - podSelector:
            matchLabels:
              {{- include "bapo.selectorLabels" (dict "root" $r "component" $client) | nindent 14 }}
        {{- end }}
      ports:
        - port: grpc
          protocol: TCP
  {{- if $np.restrictEgress }}
  {{- if or $v.extraEgress $v.dnsEgress }}
  egress:
    {{- with $v.extraEgress }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if $v.dnsEgress }}
    - ports:
        - port: 53
          protocol: UDP
        - port: 53
          protocol: TCP
    {{- end }}
  {{- else }}
  # Nothing out.
  egress: []
  {{- end }}
  {{- end }}
{{- end -}}

{{/* A client's egress rule to such a server's pods: (dict "root" $ "component" c). */}}
{{- define "bapo.userServer.egress" -}}
{{- $r := .root -}}
{{- $v := index $r.Values .component -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "bapo.selectorLabels" (dict "root" $r "component" .component) | nindent 10 }}
  ports:
    - port: {{ $v.port }}
      protocol: TCP
{{- end -}}
