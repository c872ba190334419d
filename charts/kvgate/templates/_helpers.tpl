{{/*
Names. Kubernetes names are at most 63 characters (DNS labels); every name is cut there and
loses a trailing "-".
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else the release name when it already
contains the chart name, else "<release>-<chart>".
*/}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<suffix>", cut to 63 characters. Call with (list . "suffix"). */}}
{{- define "kvgate.componentName" -}}
{{- $ctx := index . 0 }}
{{- printf "%s-%s" (include "kvgate.fullname" $ctx | trunc (int (sub 62 (len (index . 1))))) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.operatorName" -}}{{ include "kvgate.componentName" (list . "operator") }}{{- end }}
{{- define "kvgate.agentName" -}}{{ include "kvgate.componentName" (list . "agent") }}{{- end }}
{{- define "kvgate.webhookServiceName" -}}{{ include "kvgate.componentName" (list . "webhook") }}{{- end }}
{{- define "kvgate.webhookConfigName" -}}{{ include "kvgate.componentName" (list . "sidecar-injector") }}{{- end }}
{{- define "kvgate.webhookCertificateName" -}}{{ include "kvgate.componentName" (list . "webhook") }}{{- end }}
{{- define "kvgate.webhookSecretName" -}}{{ include "kvgate.componentName" (list . "webhook-tls") }}{{- end }}
{{- define "kvgate.selfSignedIssuerName" -}}{{ include "kvgate.componentName" (list . "selfsigned") }}{{- end }}

{{/* The webhook Service's DNS name inside the cluster: <svc>.<ns>.svc */}}
{{- define "kvgate.webhookHost" -}}
{{- printf "%s.%s.svc" (include "kvgate.webhookServiceName" .) .Release.Namespace }}
{{- end }}

{{- define "kvgate.operatorServiceAccountName" -}}
{{- default (include "kvgate.operatorName" .) .Values.operator.serviceAccount.name }}
{{- end }}

{{- define "kvgate.agentServiceAccountName" -}}
{{- default (include "kvgate.agentName" .) .Values.agent.serviceAccount.name }}
{{- end }}

{{/* Images: "<repository>:<tag, default appVersion>". */}}
{{- define "kvgate.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvgate.agentImage" -}}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) }}
{{- end }}

{{/* Chart label value: "<name>-<version>" ("+" is not allowed in label values). */}}
{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component. Call with (list . "component"). */}}
{{- define "kvgate.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "kvgate.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Standard labels of one component. Call with (list . "component"). */}}
{{- define "kvgate.labels" -}}
{{- $ctx := index . 0 -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvgate
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
helm.sh/chart: {{ include "kvgate.chart" $ctx }}
{{- end }}

{{/*
Namespaces the webhook never injects: the system ones and the release namespace, always, plus
injector.excludedNamespaces. Sorted and de-duplicated, as a JSON list (fromJsonArray to use).
*/}}
{{- define "kvgate.excludedNamespaces" -}}
{{- $ns := list "kube-system" "kube-public" "kube-node-lease" .Release.Namespace }}
{{- concat $ns .Values.injector.excludedNamespaces | uniq | sortAlpha | toJson }}
{{- end }}

{{/*
The injected sidecar's settings, passed to the operator as KVGATE_OPERATOR_INJECTION (JSON). The
operator reads exactly these keys.
*/}}
{{- define "kvgate.injection" -}}
{{- $i := .Values.injector }}
{{- $inj := dict
  "sidecarImage" (include "kvgate.agentImage" .)
  "imagePullPolicy" $i.imagePullPolicy
  "nativeSidecar" $i.nativeSidecar
  "sidecarPort" $i.sidecarPort
  "adminPort" $i.adminPort
  "agentPort" .Values.agent.port
  "tokenAudience" "kvgate-agent"
  "tokenExpirationSeconds" $i.tokenExpirationSeconds
  "resources" $i.resources
  "excludedNamespaces" (include "kvgate.excludedNamespaces" . | fromJsonArray)
  "ownNamespace" .Release.Namespace
  "drainSeconds" $i.drainSeconds
  "headerTimeoutSeconds" $i.headerTimeoutSeconds
  "bodyTimeoutSeconds" $i.bodyTimeoutSeconds
  "upstreamTimeoutSeconds" $i.upstreamTimeoutSeconds
  "logLevel" $i.logLevel
  "passthroughPaths" $i.passthroughPaths
  "apiKeysSecret" $i.apiKeysSecret
  "apiKeysKey" $i.apiKeysKey
  "jwksSecret" $i.jwksSecret
  "jwksKey" $i.jwksKey
  "eppEngineType" $i.eppEngineType }}
{{- with .Values.store }}
{{- if .url }}
{{- $s := dict "url" .url "passwordKey" .passwordKey "tls" (dict "caKey" .tls.caKey) }}
{{- if .existingSecret }}{{- $_ := set $s "existingSecret" .existingSecret }}{{- end }}
{{- if .tls.caSecret }}{{- $_ := set $s.tls "caSecret" .tls.caSecret }}{{- end }}
{{- if .shareSync }}{{- $_ := set $s "shareSync" .shareSync }}{{- end }}
{{- $_ := set $inj "store" $s }}
{{- end }}
{{- end }}
{{- $inj | toJson }}
{{- end }}

{{/* Restricted Pod Security for a container (the operator's; the agent's adds hostPID). */}}
{{- define "kvgate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Checks across values that the schema cannot express; fails the render with the reason.
*/}}
{{- define "kvgate.validate" -}}
{{- $w := .Values.webhook }}
{{- if and $w.certManager.enabled $w.caBundle }}
{{- fail "webhook.caBundle and webhook.certManager.enabled exclude each other: cert-manager's cainjector sets the caBundle" }}
{{- end }}
{{- if and $w.certManager.enabled $w.url }}
{{- fail "webhook.url and webhook.certManager.enabled exclude each other: the certificate is for the in-cluster Service" }}
{{- end }}
{{- if and .Values.store.shareSync (not .Values.store.url) }}
{{- fail "store.shareSync needs store.url: the sidecars exchange their service counters through the store" }}
{{- end }}
{{- end }}
