{{/* Names, labels and the pieces the head and worker pod templates share. */}}

{{- define "pagerail.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Truncated to 40 characters so that suffixed names ("-ray-head", "-workers") stay valid DNS labels. */}}
{{- define "pagerail.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagerail.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagerail.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagerail.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagerail.labels" -}}
helm.sh/chart: {{ include "pagerail.chart" . }}
{{ include "pagerail.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagerail.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pagerail.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagerail.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Ray head's address for workers. The Service publishes the head before it is ready: the head only
     becomes ready once the workers have joined it. */}}
{{- define "pagerail.rayHeadService" -}}
{{- printf "%s-ray-head" (include "pagerail.fullname" .) -}}
{{- end -}}

{{- define "pagerail.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "pagerail.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "pagerail.apiKeySecretKey" -}}
{{- if .Values.apiKey.existingSecret -}}{{ .Values.apiKey.existingSecretKey }}{{- else -}}api-key{{- end -}}
{{- end -}}

{{- define "pagerail.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "pagerail.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}

{{- define "pagerail.rayTokenSecretKey" -}}
{{- if .Values.ray.auth.existingSecret -}}{{ .Values.ray.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* Values that the schema cannot check on its own; a wrong combination fails the render with a reason. */}}
{{- define "pagerail.validate" -}}
{{- $v := .Values -}}
{{- if and $v.apiKey.value $v.apiKey.existingSecret -}}
{{- fail "apiKey: set either value or existingSecret, not both" -}}
{{- end -}}
{{- $dp := $v.serve.dataParallelSize -}}
{{- if ne (toString $dp) "auto" -}}
{{- $low := ternary $dp $v.serve.minReplicas (kindIs "invalid" $v.serve.minReplicas) -}}
{{- $high := ternary $dp $v.serve.maxReplicas (kindIs "invalid" $v.serve.maxReplicas) -}}
{{- if or (lt (int $dp) (int $low)) (gt (int $dp) (int $high)) -}}
{{- fail (printf "serve.dataParallelSize %d must lie between serve.minReplicas %d and serve.maxReplicas %d" (int $dp) (int $low) (int $high)) -}}
{{- end -}}
{{- end -}}
{{- if ne $v.serve.device "cpu" -}}
{{- $gpus := add $v.head.gpus (mul $v.worker.replicas $v.worker.gpus) -}}
{{- if ne (toString $dp) "auto" -}}
{{- $needed := mul $v.serve.tensorParallelSize $dp -}}
{{- if gt (int $needed) (int $gpus) -}}
{{- fail (printf "serve.dataParallelSize %d x serve.tensorParallelSize %d needs %d GPUs, but head.gpus + worker.replicas x worker.gpus is %d" (int $dp) (int $v.serve.tensorParallelSize) (int $needed) (int $gpus)) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $v.serve.tensorParallelSize) (int $gpus) -}}
{{- fail (printf "serve.tensorParallelSize %d needs %d GPUs, but head.gpus + worker.replicas x worker.gpus is %d" (int $v.serve.tensorParallelSize) (int $v.serve.tensorParallelSize) (int $gpus)) -}}
{{- end -}}
{{- if and (eq $v.serve.placementStrategy "STRICT_PACK") (gt (int $v.serve.tensorParallelSize) (int (max $v.head.gpus $v.worker.gpus))) -}}
{{- fail (printf "serve.placementStrategy STRICT_PACK puts all %d ranks in one pod, but no pod has that many GPUs" (int $v.serve.tensorParallelSize)) -}}
{{- end -}}
{{- if eq $v.serve.placementStrategy "STRICT_SPREAD" -}}
{{- $nodes := add (ternary 1 0 (gt (int $v.head.gpus) 0)) (ternary $v.worker.replicas 0 (gt (int $v.worker.gpus) 0)) -}}
{{- if gt (int $v.serve.tensorParallelSize) (int $nodes) -}}
{{- fail (printf "serve.placementStrategy STRICT_SPREAD puts one rank per pod: %d ranks need %d pods with GPUs, there are %d" (int $v.serve.tensorParallelSize) (int $v.serve.tensorParallelSize) (int $nodes)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.kuberay.enabled (eq $v.modelCache.type "pvc") (not $v.modelCache.pvc.existingClaim) -}}
{{- fail "kuberay.enabled: KubeRay makes no per-pod claims; set modelCache.pvc.existingClaim (ReadWriteMany), or modelCache.type hostPath or emptyDir" -}}
{{- end -}}
{{- end -}}

{{/* `pagerail serve` flags from values; the head's script hands them over as "$@", so nothing is re-quoted. */}}
{{- define "pagerail.serveArgs" -}}
{{- $s := .Values.serve -}}
- --host
- 0.0.0.0
- --port
- "8000"
- --grpc-port
- "50051"
- --ray-address
- auto
{{- with .Values.model.name }}
- --model
- {{ . | quote }}
{{- end }}
{{- with .Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --tensor-parallel-size
- {{ $s.tensorParallelSize | quote }}
- --data-parallel-size
- {{ $s.dataParallelSize | quote }}
- --routing-policy
- {{ $s.routingPolicy }}
{{- if not (kindIs "invalid" $s.minReplicas) }}
- --min-replicas
- {{ $s.minReplicas | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.maxReplicas) }}
- --max-replicas
- {{ $s.maxReplicas | int64 | quote }}
{{- end }}
- --target-waiting-per-replica
- {{ $s.targetWaitingPerReplica | quote }}
- --placement-strategy
- {{ $s.placementStrategy }}
- --device
- {{ $s.device }}
- --dtype
- {{ $s.dtype }}
{{- if not (kindIs "invalid" $s.maxModelLen) }}
- --max-model-len
- {{ $s.maxModelLen | int64 | quote }}
{{- end }}
- --max-num-seqs
- {{ $s.maxNumSeqs | int64 | quote }}
- --max-num-batched-tokens
- {{ $s.maxNumBatchedTokens | int64 | quote }}
{{- if not (kindIs "invalid" $s.maxWaitingRequests) }}
- --max-waiting-requests
- {{ $s.maxWaitingRequests | int64 | quote }}
{{- end }}
- --gpu-memory-utilization
- {{ $s.gpuMemoryUtilization | quote }}
- --drain-timeout
- {{ $s.drainTimeout | quote }}
- --log-format
- {{ $s.logFormat }}
{{- with .Values.tracing.otlpEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.tracing.samplingRatio) }}
- --trace-sampling-ratio
- {{ .Values.tracing.samplingRatio | quote }}
{{- end }}
{{- range $s.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Environment shared by every Ray container: Ray's token, the model cache, the hub token. */}}
{{- define "pagerail.commonEnv" -}}
- name: PAGERAIL_CACHE_DIR
  value: {{ .Values.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" (trimSuffix "/" .Values.modelCache.mountPath) | quote }}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pagerail.rayTokenSecretName" . }}
      key: {{ include "pagerail.rayTokenSecretKey" . }}
{{- end }}
{{- with .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.hfTokenSecret.key }}
{{- end }}
{{- end -}}

{{/* The cache volume, unless the StatefulSet makes a claim per pod (then its volumeClaimTemplates do). */}}
{{- define "pagerail.perPodClaim" -}}
{{- if and (eq .Values.modelCache.type "pvc") (not .Values.modelCache.pvc.existingClaim) (not .Values.kuberay.enabled) -}}true{{- end -}}
{{- end -}}

{{- define "pagerail.cacheVolume" -}}
{{- $c := .Values.modelCache -}}
{{- if eq $c.type "pvc" }}
{{- if $c.pvc.existingClaim }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ $c.pvc.existingClaim }}
{{- end }}
{{- else if eq $c.type "hostPath" }}
- name: model-cache
  hostPath:
    path: {{ $c.hostPath.path }}
    type: DirectoryOrCreate
{{- else }}
- name: model-cache
  emptyDir:
    sizeLimit: {{ $c.emptyDir.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "pagerail.volumeClaimTemplates" -}}
{{- $c := .Values.modelCache -}}
volumeClaimTemplates:
  - metadata:
      name: model-cache
    spec:
      accessModes:
        {{- toYaml $c.pvc.accessModes | nindent 8 }}
      {{- with $c.pvc.storageClassName }}
      storageClassName: {{ . }}
      {{- end }}
      resources:
        requests:
          storage: {{ $c.pvc.size }}
{{- end -}}

{{/* Resources with the GPUs added; an extended resource needs only its limit (the request follows it). */}}
{{- define "pagerail.resources" -}}
{{- $resources := deepCopy (default dict .resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := deepCopy (default dict (get $resources "limits")) -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* The pod spec of the head: Ray head, then `pagerail serve` in the same container (exec, so it gets
     SIGTERM and drains). `kuberay` is true inside a RayCluster. */}}
{{- define "pagerail.headPodSpec" -}}
{{- $ := .root -}}
{{- $v := $.Values -}}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "pagerail.serviceAccountName" $ }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
# Longer than the drain: requests in flight finish before the pod goes.
terminationGracePeriodSeconds: {{ add (int $v.serve.drainTimeout) 30 }}
{{- with $v.head.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: ray-head
    image: {{ include "pagerail.image" $ }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    # tini reaps the Ray daemons; the script's own arguments ("$@") are the serve flags below.
    command:
      - tini
      - --
      - /bin/bash
      - -c
      - |
        set -e
        ulimit -n 65536 2>/dev/null || true
        ray start --head --port=6379 --dashboard-host=0.0.0.0 --dashboard-port=8265 \
          --include-dashboard={{ $v.ray.dashboard }} --ray-client-server-port=10001 \
          --num-gpus={{ $v.head.gpus }}{{ with $v.ray.objectStoreMemory }} --object-store-memory={{ int64 . }}{{ end }} --disable-usage-stats
        exec pagerail serve "$@"
      - pagerail-serve
    args:
      {{- include "pagerail.serveArgs" $ | nindent 6 }}
    env:
      {{- include "pagerail.commonEnv" $ | nindent 6 }}
      {{- if include "pagerail.apiKeySecretName" $ }}
      - name: PAGERAIL_API_KEY
        valueFrom:
          secretKeyRef:
            name: {{ include "pagerail.apiKeySecretName" $ }}
            key: {{ include "pagerail.apiKeySecretKey" $ }}
      {{- end }}
      {{- with $v.head.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - name: http
        containerPort: 8000
      - name: grpc
        containerPort: 50051
      - name: gcs-server
        containerPort: 6379
      - name: dashboard
        containerPort: 8265
      - name: client
        containerPort: 10001
    startupProbe:
      {{- if eq $v.probes.startup.type "grpc" }}
      grpc:
        port: 50051
      {{- else }}
      httpGet:
        path: /ready
        port: http
      {{- end }}
      periodSeconds: {{ $v.probes.startup.periodSeconds }}
      failureThreshold: {{ $v.probes.startup.failureThreshold }}
      timeoutSeconds: 5
    readinessProbe:
      httpGet:
        path: /ready
        port: http
      periodSeconds: {{ $v.probes.readiness.periodSeconds }}
      failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      timeoutSeconds: 5
    livenessProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: {{ $v.probes.liveness.periodSeconds }}
      failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      timeoutSeconds: 5
    resources:
      {{- include "pagerail.resources" (dict "resources" $v.head.resources "gpus" $v.head.gpus) | nindent 6 }}
    securityContext:
      {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - name: dshm
        mountPath: /dev/shm
      - name: model-cache
        mountPath: {{ $v.modelCache.mountPath }}
volumes:
  # Memory-backed and bounded: the container default of 64 MiB is far too small for Ray and NCCL.
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.head.shmSize }}
  {{- with (include "pagerail.cacheVolume" $ | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The pod spec of a GPU worker: one Ray node that joins the head and holds worker.gpus ranks. */}}
{{- define "pagerail.workerPodSpec" -}}
{{- $ := .root -}}
{{- $v := $.Values -}}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "pagerail.serviceAccountName" $ }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.worker.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.worker.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.worker.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: ray-worker
    image: {{ include "pagerail.image" $ }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command:
      - tini
      - --
      - /bin/bash
      - -c
      - |
        ulimit -n 65536 2>/dev/null || true
        {{- if .kuberay }}
        # KubeRay's own `ray start --address=<its head service> --block ...`, with the GPUs of the limits;
        # eval, since KubeRay writes it for a shell to parse.
        eval "exec $KUBERAY_GEN_RAY_START_CMD"
        {{- else }}
        head={{ include "pagerail.rayHeadService" $ }}
        # Joining fails outright while the head's name does not resolve yet; wait for the GCS port instead.
        until (exec 3<>/dev/tcp/$head/6379) 2>/dev/null; do echo "waiting for the Ray head at $head:6379"; sleep 5; done
        exec ray start --address=$head:6379 --num-gpus={{ $v.worker.gpus }}{{ with $v.ray.objectStoreMemory }} --object-store-memory={{ int64 . }}{{ end }} --disable-usage-stats --block
        {{- end }}
    env:
      {{- include "pagerail.commonEnv" $ | nindent 6 }}
      {{- with $v.worker.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    resources:
      {{- include "pagerail.resources" (dict "resources" $v.worker.resources "gpus" $v.worker.gpus) | nindent 6 }}
    securityContext:
      {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - name: dshm
        mountPath: /dev/shm
      - name: model-cache
        mountPath: {{ $v.modelCache.mountPath }}
volumes:
  # Memory-backed and bounded: NCCL's shared-memory transport between the ranks of a pod lives here.
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.worker.shmSize }}
  {{- with (include "pagerail.cacheVolume" $ | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end -}}
